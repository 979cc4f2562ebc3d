#!/usr/bin/env python
"""MindSpore training step with our DistributedGradReducer, GRAPH_MODE against PyNative, in the
same processes: `nn.TrainOneStepCell` (forward, backward, reducer, optimizer) timed per mode.

    /path/to/.venv-ms/bin/python scripts/bench_ms_graph.py    # 2 ranks through nccl-ddp-run
    nccl-ddp-run --nproc-per-node 2 scripts/bench_ms_graph.py --steps 20

Models: LeNet5 of examples/ms_ddp_lenet.py (batch 16, 0.24 MiB of grads, one bucket) and an MLP
(1024-2048-2048-10, batch 64, 24 MiB, two buckets). Reducers: `none` (the local step, no
communication), `per-bucket` (ours: one run-time op per bucket in the graph) and, in GRAPH_MODE
only, `one-op` (the alternative: all grads in one op that runs the whole reducer; in PyNative mode
the reducer Cell calls the reducer directly, no op). A round's
time is the slowest rank's mean; graph_vs_pynative = graph step / PyNative step, same reducer;
reducer_ms = step - the `none` step of the same mode. Every configuration is timed in each of
--rounds rounds, interleaved, so all see the same load; step_ms is the median over the rounds and
spread_ms the max - min. Rank 0 prints the table and writes the CSV.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from benchlib import bench_parser, format_table, run_ranks, timed_steps, write_csv  # noqa: E402

COLUMNS = (
    "model",
    "params_MiB",
    "buckets",
    "reducer",
    "mode",
    "step_ms",
    "spread_ms",
    "reducer_ms",
    "graph_vs_pynative",
)
FORMATS = {
    "params_MiB": ".2f",
    "step_ms": ".1f",
    "spread_ms": ".1f",
    "reducer_ms": ".1f",
    "graph_vs_pynative": ".2f",
}


def parse_args(argv=None):
    p = bench_parser(__doc__, "bench_ms_graph", steps=10)
    p.add_argument("--models", default="lenet,mlp")
    return p.parse_args(argv)


def make_model(name: str, rank: int):
    """(network, one batch for `rank`) of a model."""
    import mindspore as ms
    from mindspore import nn

    g = np.random.default_rng(7 + rank)
    ms.set_seed(0)
    if name == "lenet":
        from ms_ddp_lenet import LeNet5

        return LeNet5(), (
            ms.Tensor(g.standard_normal((16, 1, 32, 32)).astype(np.float32)),
            ms.Tensor(g.integers(0, 10, 16).astype(np.int32)),
        )
    net = nn.SequentialCell(
        nn.Dense(1024, 2048), nn.ReLU(), nn.Dense(2048, 2048), nn.ReLU(), nn.Dense(2048, 10)
    )
    return net, (
        ms.Tensor(g.standard_normal((64, 1024)).astype(np.float32)),
        ms.Tensor(g.integers(0, 10, 64).astype(np.int32)),
    )


def one_op_reducer(parameters):
    """The alternative design, for comparison: one op for the whole tuple (all grads concatenated,
    one dtype), whose run-time function calls the whole reducer (pack + all-reduce pipelined)."""
    from mindspore import ops

    import nccl_ddp as nd

    cell = nd.DistributedGradReducer(parameters, mean=True)
    specs = cell.reducer.specs
    shapes = [spec.shape for spec in specs]
    sizes = [int(np.prod(s)) for s in shapes]
    bounds = np.cumsum([0, *sizes])
    dtype = parameters[0].dtype
    # the pyfunc op hands NumPy arrays to its function: reduce them with a reducer built on NumPy
    # arrays of the same shapes (one on MindSpore parameters refuses other frameworks' arrays)
    reducer = nd.DistributedGradReducer([np.zeros(s.shape, s.dtype) for s in specs], mean=True)

    def reduce_all(flat):
        grads = [flat[lo:hi].reshape(s) for lo, hi, s in zip(bounds, bounds[1:], shapes)]
        return tuple(g.reshape(-1) for g in reducer(grads))

    class OneOp(type(cell)):
        def __init__(self):
            super().__init__(cell.reducer)
            self.op = ops.Custom(
                reduce_all, out_shape=[[n] for n in sizes], out_dtype=[dtype] * len(sizes), func_type="pyfunc"
            )

        def construct(self, grads):
            out = self.op(self.concat([self.reshape(g, (-1,)) for g in grads]))
            return tuple([self.reshape(o, s) for o, s in zip(out, self.shapes)])

    return OneOp()


class Config:
    """One timed configuration: a model's train step with a reducer kind, run in one mode."""

    def __init__(self, nd, model: str, kind: str, mode_name: str) -> None:
        import mindspore as ms
        from mindspore import nn

        self.model, self.kind, self.mode_name = model, kind, mode_name
        self.mode = ms.GRAPH_MODE if mode_name == "graph" else ms.PYNATIVE_MODE
        self.net, (self.x, self.y) = make_model(model, nd.get_rank())
        optimizer = nn.Momentum(self.net.trainable_params(), 0.01, 0.9)
        loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.step_cell = nn.TrainOneStepCell(nn.WithLossCell(self.net, loss), optimizer)
        self.reducer = None
        if kind == "per-bucket":
            self.reducer = nd.DistributedGradReducer(optimizer.parameters, mean=True)
        elif kind == "one-op":
            self.reducer = one_op_reducer(optimizer.parameters)
        if self.reducer is not None:
            self.step_cell.grad_reducer = self.reducer
        self.step_cell.set_train()

    def time(self, nd, warmup: int, steps: int) -> float:
        import mindspore as ms

        ms.set_context(mode=self.mode)
        return timed_steps(nd, lambda: self.step_cell(self.x, self.y).asnumpy(), warmup, steps, lambda: None)

    def row(self, seconds: list) -> dict:
        params = self.net.trainable_params()
        return {
            "model": self.model,
            "params_MiB": sum(p.size * 4 for p in params) / 2**20,
            "buckets": len(self.reducer.bucket_ops) if self.reducer is not None else 0,
            "reducer": self.kind,
            "mode": self.mode_name,
            "step_ms": float(np.median(seconds)) * 1e3,
            "spread_ms": (max(seconds) - min(seconds)) * 1e3,
        }


def worker(args) -> None:
    import mindspore as ms
    import ms_ddp_lenet  # noqa: F401  (it sets PyNative mode when imported: before measuring)

    import nccl_ddp as nd

    ms.set_device("CPU")
    nd.init_process_group()
    configs = [
        Config(nd, model, kind, mode_name)
        for model in args.models.split(",")
        for kind in ("none", "per-bucket", "one-op")
        for mode_name in (("graph", "pynative") if kind != "one-op" else ("graph",))
    ]
    seconds: dict = {c: [] for c in configs}
    for r in range(args.rounds):  # interleaved: every configuration sees the same load
        for c in configs:
            seconds[c].append(c.time(nd, args.warmup if r == 0 else 1, args.steps))
    rows = [c.row(seconds[c]) for c in configs]
    same = {(o["model"], o["reducer"], o["mode"]): o["step_ms"] for o in rows}
    for r in rows:
        local = same.get((r["model"], "none", r["mode"]))
        if r["reducer"] != "none" and local is not None:
            r["reducer_ms"] = r["step_ms"] - local
        pynative = same.get((r["model"], r["reducer"], "pynative"))
        if r["mode"] == "graph" and pynative:
            r["graph_vs_pynative"] = r["step_ms"] / pynative
    if nd.get_rank() == 0:
        print(format_table(rows, COLUMNS, FORMATS))
        if args.csv:
            os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
            write_csv(rows, args.csv)
    for c in configs:
        if c.reducer is not None:
            c.reducer.close()
    nd.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not under a launcher: start the ranks through nccl-ddp-run
        return run_ranks(
            __file__,
            args.nranks,
            sys.argv[1:] if argv is None else argv,
            args.timeout,
            dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3")),
        )
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
