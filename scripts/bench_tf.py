#!/usr/bin/env python
"""TensorFlow training step with our DistributedGradReducer eagerly, outside and inside
`tf.function` (the `tf.numpy_function` bridge), and TensorFlow's own MultiWorkerMirroredStrategy.
Runs in .venv-tf (scripts/setup_tf_venv.sh).

    .venv-tf/bin/python scripts/bench_tf.py                  # 2 ranks through nccl-ddp-run
    .venv-tf/bin/python scripts/bench_tf.py --mode mwms      # TensorFlow's own, same models

Models: MLPs with tanh hidden layers (small: 784-256-10, batch 64, 0.8 MiB of float32 grads;
large: 1024-2048-2048-10, batch 64, 24 MiB). A step is grads (GradientTape), mean over the ranks,
SGD update. Forms (--mode ours): `none` (the step in tf.function, no communication: the local
cost), `eager` (the whole step eager, the reducer on the tape's tensors), `outside` (grads and
update in tf.function, the reducer between them on concrete tensors), `inside` (the whole step in
one tf.function with the reducer in it). --mode mwms: `mwms` (the step in tf.function under
tf.distribute.MultiWorkerMirroredStrategy, grads all-reduced by the replica context: TensorFlow's
ring collectives over gRPC). reducer_ms = step - the `none` step of the same model (mwms: against
a `none` step timed in the same processes). Every form is timed in each of --rounds interleaved
rounds; step_ms is the median round (slowest rank), spread_ms max - min. Rank 0 prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import bench_parser, format_table, launch_or_work, timed_steps  # noqa: E402

COLUMNS = ("model", "grads_MiB", "form", "step_ms", "spread_ms", "reducer_ms", "vs_outside")
FORMATS = {k: ".2f" for k in ("grads_MiB", "step_ms", "spread_ms", "reducer_ms", "vs_outside")}
MODELS = {"small": (784, 256, 10), "large": (1024, 2048, 2048, 10)}
BATCH, LR = 64, 0.01


def parse_args(argv=None):
    p = bench_parser(__doc__, None, steps=10, warmup=2)
    p.add_argument("--mode", choices=("ours", "mwms"), default="ours")
    p.add_argument("--models", default="small,large")
    return p.parse_args(argv)


class Config:
    """One timed form of one model's train step."""

    def __init__(self, nd, model: str, form: str, rank: int, strategy=None) -> None:
        import tensorflow as tf

        self.model, self.form = model, form
        sizes = MODELS[model]
        g = np.random.default_rng(0)

        def make_vars():
            return [
                tf.Variable((g.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
                for a, b in zip(sizes, sizes[1:])
            ] + [tf.Variable(np.zeros(b, np.float32)) for b in sizes[1:]]

        if strategy is not None:
            with strategy.scope():
                self.vars = make_vars()
        else:
            self.vars = make_vars()
        n = len(sizes) - 1
        g = np.random.default_rng(1 + rank)
        self.x = tf.constant(g.standard_normal((BATCH, sizes[0]), dtype=np.float32))
        self.y = tf.constant(g.standard_normal((BATCH, sizes[-1]), dtype=np.float32))
        reduces = form in ("eager", "outside", "inside")
        self.reducer = nd.DistributedGradReducer(self.vars) if reduces else None
        ws, bs = self.vars[:n], self.vars[n:]

        def grads(x, y):
            with tf.GradientTape() as tape:
                h = x
                for w, b in zip(ws[:-1], bs[:-1]):
                    h = tf.tanh(h @ w + b)
                loss = tf.reduce_mean((h @ ws[-1] + bs[-1] - y) ** 2)
            return tape.gradient(loss, self.vars)

        def update(gs):
            for v, gr in zip(self.vars, gs):
                v.assign_sub(LR * gr)

        reducer = self.reducer
        if form == "none":
            self.step = tf.function(lambda x, y: update(grads(x, y)))
        elif form == "eager":
            self.step = lambda x, y: update(reducer(grads(x, y)))
        elif form == "outside":
            jit_grads, jit_update = tf.function(grads), tf.function(update)
            self.step = lambda x, y: jit_update(reducer(jit_grads(x, y)))
        elif form == "inside":
            self.step = tf.function(lambda x, y: update(reducer(grads(x, y))))
        else:  # mwms

            def replica_step(x, y):
                gs = grads(x, y)
                gs = tf.distribute.get_replica_context().all_reduce("mean", gs)
                update(gs)

            self.step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))

    def run_step(self) -> None:
        self.step(self.x, self.y)
        _ = self.vars[0].numpy()[0, 0]  # wait for the step (eager ops may still be running)

    def row(self, seconds: list) -> dict:
        nbytes = sum(int(np.prod(v.shape)) * 4 for v in self.vars)
        return {
            "model": self.model,
            "grads_MiB": nbytes / 2**20,
            "form": self.form,
            "step_ms": float(np.median(seconds)) * 1e3,
            "spread_ms": (max(seconds) - min(seconds)) * 1e3,
        }


def _mwms(rank: int, world: int):
    """TensorFlow's MultiWorkerMirroredStrategy on ports next to the launcher's MASTER_PORT."""
    port = int(os.environ["MASTER_PORT"])
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{port + 10 + i}" for i in range(world)]},
            "task": {"type": "worker", "index": rank},
        }
    )
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy()


def worker(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = _mwms(rank, world) if args.mode == "mwms" else None  # before any other TF op
    import nccl_ddp as nd

    nd.init_process_group()
    forms = ("none", "eager", "outside", "inside") if args.mode == "ours" else ("none", "mwms")
    configs = [
        Config(nd, model, form, rank, strategy if form == "mwms" else None)
        for model in args.models.split(",")
        for form in forms
    ]
    times: list = [[] for _ in configs]
    t0 = time.perf_counter()
    for r in range(args.rounds):  # interleaved: every form sees the same load
        for c, t in zip(configs, times):
            t.append(timed_steps(nd, c.run_step, args.warmup if r == 0 else 1, args.steps, lambda: None))
    rows = [c.row(t) for c, t in zip(configs, times)]
    by = {(r["model"], r["form"]): r for r in rows}
    for r in rows:
        r["reducer_ms"] = r["step_ms"] - by[(r["model"], "none")]["step_ms"] if r["form"] != "none" else None
        outside = by.get((r["model"], "outside"))
        r["vs_outside"] = r["step_ms"] / outside["step_ms"] if outside and r["form"] != "none" else None
    if rank == 0:
        print(format_table(rows, COLUMNS, FORMATS))
        print(f"({time.perf_counter() - t0:.0f} s)")
    for c in configs:
        if c.reducer is not None:
            c.reducer.close()
    nd.destroy_process_group()


def main(argv=None) -> int:
    return launch_or_work(__file__, parse_args(argv), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
