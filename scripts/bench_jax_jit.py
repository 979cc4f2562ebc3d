#!/usr/bin/env python
"""JAX training step with our DistributedGradReducer inside `jax.jit` (one ordered io_callback)
against reducing outside jit, in the same processes.

    python scripts/bench_jax_jit.py                  # 2 ranks through nccl-ddp-run
    nccl-ddp-run --nproc-per-node 2 scripts/bench_jax_jit.py --steps 20

Models: MLPs with tanh hidden layers (small: 784-256-10, batch 64, 0.8 MiB of float32 grads;
large: 1024-2048-2048-10, batch 64, 24 MiB). A step is grads, mean over the ranks, SGD update.
Forms: `none` (the whole step jitted, no communication: the local cost), `outside` (jitted grads,
the reducer called on the concrete grads, jitted update: two jitted calls per step), `inside`
(the whole step jitted, the reducer inside it). reducer_ms = step - the `none` step of the same
model; inside_vs_outside = inside step / outside step. Every form is timed in each of --rounds
interleaved rounds; step_ms is the median round (slowest rank), spread_ms max - min. Rank 0 prints
the table and writes the CSV.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import bench_parser, format_table, launch_or_work, timed_steps, write_csv  # noqa: E402

COLUMNS = ("model", "grads_MiB", "form", "step_ms", "spread_ms", "reducer_ms", "inside_vs_outside")
FORMATS = {
    "grads_MiB": ".2f",
    "step_ms": ".2f",
    "spread_ms": ".2f",
    "reducer_ms": ".2f",
    "inside_vs_outside": ".2f",
}
MODELS = {"small": (784, 256, 10), "large": (1024, 2048, 2048, 10)}
BATCH, LR = 64, 0.01
FORMS = ("none", "outside", "inside")


def parse_args(argv=None):
    p = bench_parser(__doc__, "bench_jax_jit")
    p.add_argument("--models", default="small,large")
    return p.parse_args(argv)


class Config:
    """One timed form of one model's train step."""

    def __init__(self, nd, model: str, form: str) -> None:
        import jax
        import jax.numpy as jnp

        self.model, self.form = model, form
        sizes = MODELS[model]
        g = np.random.default_rng(0)
        self.params = [
            {
                "w": jnp.asarray(g.standard_normal((a, b), dtype=np.float32) / np.sqrt(a)),
                "b": jnp.zeros(b, jnp.float32),
            }
            for a, b in zip(sizes, sizes[1:])
        ]
        g = np.random.default_rng(1 + nd.get_rank())
        self.x = jnp.asarray(g.standard_normal((BATCH, sizes[0]), dtype=np.float32))
        self.y = jnp.asarray(g.standard_normal((BATCH, sizes[-1]), dtype=np.float32))
        self.reducer = nd.DistributedGradReducer(self.params, mean=True) if form != "none" else None

        def loss(params, x, y):
            h = x
            for layer in params[:-1]:
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)

        def update(params, grads):
            return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)

        grad = jax.grad(loss)
        if form == "none":
            self.step = jax.jit(lambda p, x, y: update(p, grad(p, x, y)))
        elif form == "inside":
            reducer = self.reducer
            self.step = jax.jit(lambda p, x, y: update(p, reducer(grad(p, x, y))))
        else:
            jit_grad, jit_update, reducer = jax.jit(grad), jax.jit(update), self.reducer
            self.step = lambda p, x, y: jit_update(p, reducer(jit_grad(p, x, y)))

    def run_step(self) -> None:
        import jax

        self.params = jax.block_until_ready(self.step(self.params, self.x, self.y))

    def time(self, nd, warmup: int, steps: int) -> float:
        return timed_steps(nd, self.run_step, warmup, steps, lambda: None)

    def row(self, seconds: list) -> dict:
        nbytes = sum(p["w"].nbytes + p["b"].nbytes for p in self.params)
        return {
            "model": self.model,
            "grads_MiB": nbytes / 2**20,
            "form": self.form,
            "step_ms": float(np.median(seconds)) * 1e3,
            "spread_ms": (max(seconds) - min(seconds)) * 1e3,
        }


def worker(args) -> None:
    import nccl_ddp as nd

    nd.init_process_group()
    configs = [Config(nd, model, form) for model in args.models.split(",") for form in FORMS]
    times: list = [[] for _ in configs]
    for r in range(args.rounds):  # interleaved: every form sees the same load
        for c, t in zip(configs, times):
            t.append(c.time(nd, args.warmup if r == 0 else 1, args.steps))
    rows = [c.row(t) for c, t in zip(configs, times)]
    by = {(r["model"], r["form"]): r for r in rows}
    for r in rows:
        r["reducer_ms"] = r["step_ms"] - by[(r["model"], "none")]["step_ms"] if r["form"] != "none" else None
        r["inside_vs_outside"] = (
            r["step_ms"] / by[(r["model"], "outside")]["step_ms"] if r["form"] == "inside" else None
        )
    for c in configs:
        if c.reducer is not None:
            c.reducer.close()
    if nd.get_rank() == 0:
        print(format_table(rows, COLUMNS, FORMATS))
        if args.csv:
            os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
            write_csv(rows, args.csv)
    nd.destroy_process_group()


def main(argv=None) -> int:
    return launch_or_work(__file__, parse_args(argv), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
