#!/usr/bin/env python
"""Horovod's torch API on our runtime: a training step with `nccl_ddp.horovod.torch`'s
DistributedOptimizer beside our DistributedDataParallel and torch's (gloo on the CPU), in the same
processes.

    python scripts/bench_horovod.py                      # 2 ranks through nccl-ddp-run
    nccl-ddp-run --nproc-per-node 2 scripts/bench_horovod.py --steps 20

Model: an MLP 256-512-256-10 (1.01 MiB of float32 grads), batch 64 per rank, cross-entropy, SGD;
a step is forward, backward, optimizer step and zero_grad. Configurations: `none` (the bare model,
no communication), `hvd.DistributedOptimizer` (the Horovod facade: our buckets through the
optimizer's grad hooks), `nd.DistributedDataParallel` and torch's DDP. Every configuration is timed
in each of --rounds rounds, interleaved, so all see the same load; a round's time is the slowest
rank's mean; step_ms is the median round, spread_ms max - min, comm_ms = step - the `none` step.
Rank 0 prints the table and writes the CSV.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import bench_parser, format_table, init_torch_pg, launch_or_work, timed_steps, write_csv  # noqa: E402

COLUMNS = ("wrapper", "params_MiB", "step_ms", "spread_ms", "comm_ms")
FORMATS = {"params_MiB": ".2f", "step_ms": ".1f", "spread_ms": ".1f", "comm_ms": ".1f"}


def parse_args(argv=None):
    p = bench_parser(__doc__, "bench_horovod")
    return p.parse_args(argv)


def worker(args) -> None:
    import torch

    import nccl_ddp as nd
    import nccl_ddp.horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    init_torch_pg(nd, torch, "gloo")
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )  # fmt: skip

    def stepper(model, forward, opt):
        def step():
            torch.nn.functional.cross_entropy(forward(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    steps = {}
    bare = mlp()
    steps["none"] = stepper(bare, bare, torch.optim.SGD(bare.parameters(), lr=1e-3))
    model = mlp()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
    )
    steps["hvd.DistributedOptimizer"] = stepper(model, model, opt)
    ours = mlp()
    ddp = nd.DistributedDataParallel(ours)
    steps["nd.DistributedDataParallel"] = stepper(ours, ddp, torch.optim.SGD(ours.parameters(), lr=1e-3))
    theirs = mlp()
    tddp = torch.nn.parallel.DistributedDataParallel(theirs, gradient_as_bucket_view=True)
    steps["torch DDP (gloo)"] = stepper(theirs, tddp, torch.optim.SGD(theirs.parameters(), lr=1e-3))
    params_mib = sum(p.numel() * 4 for p in bare.parameters()) / 2**20
    times: dict = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(timed_steps(nd, step, args.warmup, args.steps, lambda: None))
    none = float(np.median(times["none"]))
    rows = []
    for name, ts in times.items():
        med = float(np.median(ts))
        rows.append(
            dict(
                wrapper=name,
                params_MiB=params_mib,
                step_ms=med * 1e3,
                spread_ms=(max(ts) - min(ts)) * 1e3,
                comm_ms=None if name == "none" else (med - none) * 1e3,
            )
        )
    if hvd.rank() == 0:
        print(format_table(rows, COLUMNS, FORMATS))
        if args.csv:
            write_csv(rows, args.csv)
    ddp.close()
    hvd.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    return launch_or_work(__file__, args, argv, worker)


if __name__ == "__main__":
    sys.exit(main())
