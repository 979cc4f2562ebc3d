#!/usr/bin/env python
"""PaddlePaddle training step: our DistributedDataParallel against `paddle.DataParallel` (gloo on
the CPU), in the same processes.

    .venv-paddle/bin/python scripts/bench_paddle.py    # 2 ranks through nccl-ddp-run
    nccl-ddp-run --nproc-per-node 2 scripts/bench_paddle.py --steps 20

Model: an MLP 256-512-256-10 (1.01 MiB of float32 grads, one bucket of ours, one group of
Paddle's), batch 64, cross-entropy, SGD; a step is forward, backward, optimizer step and
clear_grad. Configurations: `none` (the bare model: the local step, no communication), `ours`
and `paddle.DataParallel`. Every rank joins our job and Paddle's (Paddle's environment variables,
its store on a port rank 0 picked and broadcast through ours). A round's time is the slowest
rank's mean; every configuration is timed in each of --rounds rounds, interleaved, so all see the
same load; step_ms is the median over the rounds, spread_ms the max - min, comm_ms = step - the
`none` step. Rank 0 prints the table and writes the CSV.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import bench_parser, format_table, run_ranks, timed_steps, write_csv  # noqa: E402

COLUMNS = ("wrapper", "params_MiB", "step_ms", "spread_ms", "comm_ms")
FORMATS = {"params_MiB": ".2f", "step_ms": ".1f", "spread_ms": ".1f", "comm_ms": ".1f"}


def parse_args(argv=None):
    p = bench_parser(__doc__, "bench_paddle")
    return p.parse_args(argv)


def init_paddle_gloo(nd, rank: int, world: int) -> None:
    """Paddle's process group over gloo beside ours (MASTER_ADDR/MASTER_PORT, our launcher's,
    hidden from Paddle, which would start its store there)."""
    import paddle

    port = np.zeros(1, np.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    nd.broadcast(port, 0)
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    eps = [f"127.0.0.1:{int(port[0]) + 1 + r}" for r in range(world)]
    os.environ.update(
        PADDLE_DISTRI_BACKEND="gloo",
        PADDLE_TRAINER_ID=str(rank),
        PADDLE_TRAINERS_NUM=str(world),
        PADDLE_MASTER=f"127.0.0.1:{int(port[0])}",
        PADDLE_TRAINER_ENDPOINTS=",".join(eps),
        PADDLE_CURRENT_ENDPOINT=eps[rank],
    )
    paddle.distributed.init_parallel_env()


class Config:
    """One timed configuration: the MLP's train step under a wrapper."""

    def __init__(self, nd, wrapper: str, rank: int) -> None:
        import paddle

        self.wrapper = wrapper
        paddle.seed(0)
        net = paddle.nn.Sequential(
            paddle.nn.Linear(256, 512),
            paddle.nn.ReLU(),
            paddle.nn.Linear(512, 256),
            paddle.nn.ReLU(),
            paddle.nn.Linear(256, 10),
        )
        self.params_mib = sum(int(np.prod(p.shape)) * 4 for p in net.parameters()) / 2**20
        if wrapper == "ours":
            net = nd.DistributedDataParallel(net)
        elif wrapper == "paddle.DataParallel":
            net = paddle.DataParallel(net)
        self.net = net
        self.opt = paddle.optimizer.SGD(0.01, parameters=net.parameters())
        g = np.random.default_rng(7 + rank)
        self.x = paddle.to_tensor(g.standard_normal((64, 256)).astype(np.float32))
        self.y = paddle.to_tensor(g.integers(0, 10, (64, 1)).astype(np.int64))

    def step(self) -> None:
        import paddle

        loss = paddle.nn.functional.cross_entropy(self.net(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.clear_grad()

    def row(self, seconds: list) -> dict:
        return {
            "wrapper": self.wrapper,
            "params_MiB": self.params_mib,
            "step_ms": float(np.median(seconds)) * 1e3,
            "spread_ms": (max(seconds) - min(seconds)) * 1e3,
        }


def worker(args) -> None:
    warnings.filterwarnings("ignore", message="No ccache found")
    import nccl_ddp as nd

    nd.init_process_group()
    rank = nd.get_rank()
    init_paddle_gloo(nd, rank, nd.get_world_size())
    configs = [Config(nd, w, rank) for w in ("none", "ours", "paddle.DataParallel")]
    seconds: dict = {c: [] for c in configs}
    for r in range(args.rounds):  # interleaved: every configuration sees the same load
        for c in configs:
            seconds[c].append(timed_steps(nd, c.step, args.warmup if r == 0 else 1, args.steps, lambda: None))
    rows = [c.row(seconds[c]) for c in configs]
    for r in rows[1:]:
        r["comm_ms"] = r["step_ms"] - rows[0]["step_ms"]
    if rank == 0:
        print(format_table(rows, COLUMNS, FORMATS), flush=True)
        if args.csv:
            write_csv(rows, args.csv)
    configs[1].net.close()
    nd.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not under a launcher: start the ranks through nccl-ddp-run
        return run_ranks(__file__, args.nranks, sys.argv[1:] if argv is None else argv, args.timeout)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
