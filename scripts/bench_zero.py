#!/usr/bin/env python
"""Memory and step time of the sharded optimizer (ZeRO-2) against DDP + unsharded AdamW, and
against torch DDP + torch's ZeroRedundancyOptimizer on gloo, on an MLP of about 50M parameters.

    python scripts/bench_zero.py                         # worlds 2 and 4, host backend, CPU
    python scripts/bench_zero.py --worlds 2 --steps 5 --hidden 1024

One job per (world, mode) through nccl-ddp-run, so each peak RSS is that mode's alone. Modes:
`ddp_adamw` (our DDP + torch.optim.AdamW), `zero1` (our DDP + nd.ZeroRedundancyOptimizer(AdamW),
the default: full grads in p.grad, the state sharded), `zero2` (our DDP built with zero=ZeroConfig(stage=2)),
`zero2_overlap` (the same with ZeroConfig(overlap_param_gather=True)), `torch_zero` (torch DDP + torch
ZeroRedundancyOptimizer(AdamW), gloo), `torch_zero_nd` (our DDP + torch's
ZeroRedundancyOptimizer, its broadcasts on gloo). Bytes per rank (the largest over the ranks): optimizer
state, fp32 masters, reduced grads kept for the optimizer (DDP and torch: the whole grads;
ZeRO-2: the reduce-scattered shard and its fp32 copy; ZeRO-1: the whole grads, which it reads
as views), `kept` = their sum; `grad_buf` = the
full-size grad memory backward accumulates into (DDP: the same buckets as its reduced grads;
ZeRO-2: the GradPool, one bucket per dtype, torch's .grad tensors being let go after each
step; torch: the .grad tensors, its DDP's own bucket copies
not counted); `total` = state + master + every grad byte. Step time is the slowest rank's mean
over `--steps` after `--warmup` (with `--rounds R`: the median of R jobs per mode, the modes
taking turns); `ratio` = mode / ddp_adamw, `vs_torch_zero` = mode / torch_zero in the same world.
`peak_rss` is the kernel's peak RSS, which counts every page a rank maps (on the host's shm
transport the peers' shared bucket memory too: the ranks read each other's buckets in place). Our modes then
run `--profile-steps` with the reducer's timeline on: `hidden_pct` is the share of the bucket
communication (all-reduce or reduce-scatter) that ran before backward ended, `gather_hidden_pct`
(ZeRO-2) the share of the parameter all-gathers that ran inside the next step's forward (hidden
behind it; the first profiled step has none, its gathers were queued before the timeline).
`opt_growth`: resident memory (PSS, after malloc_trim) once the timed steps are done, minus the same
measured with the model wrapped and its grads allocated (one backward) before the optimizer was
built: what the optimizer itself costs a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import date

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import format_table, run_ranks, write_csv  # noqa: E402

MODES = ("ddp_adamw", "zero1", "zero2", "zero2_overlap", "torch_zero", "torch_zero_nd")
COLUMNS = (
    "world",
    "mode",
    "params_M",
    "state_MiB",
    "master_MiB",
    "reduced_MiB",
    "kept_MiB",
    "kept_vs_ddp",
    "grad_buf_MiB",
    "total_MiB",
    "total_vs_ddp",
    "peak_rss_MiB",
    "opt_growth_MiB",
    "step_ms",
    "ratio",
    "vs_torch_zero",
    "hidden_pct",
    "gather_hidden_pct",
)
FORMATS = {
    "params_M": ".1f",
    "state_MiB": ".1f",
    "master_MiB": ".1f",
    "reduced_MiB": ".1f",
    "kept_MiB": ".1f",
    "kept_vs_ddp": ".3f",
    "grad_buf_MiB": ".1f",
    "total_MiB": ".1f",
    "total_vs_ddp": ".3f",
    "peak_rss_MiB": ".0f",
    "opt_growth_MiB": ".1f",
    "step_ms": ".0f",
    "ratio": ".2f",
    "vs_torch_zero": ".2f",
    "hidden_pct": ".0f",
    "gather_hidden_pct": ".0f",
}
MiB = float(1 << 20)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {MODES}")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12, help="hidden x hidden layers (~50M params)")
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="jobs per mode, modes in turn; median step time")
    p.add_argument("--profile-steps", type=int, default=2, help="steps with the timeline on")
    p.add_argument("--csv", default="out/bench_zero.csv", help="CSV path ('' for none)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--mode", help=argparse.SUPPRESS)  # one job's mode (set by the parent)
    p.add_argument("--out", help=argparse.SUPPRESS)  # where rank 0 writes the job's row
    return p.parse_args(argv)


def model(args):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(optimizer) -> int:
    import torch

    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def rss_trimmed() -> int:
    """This process's resident bytes after freed heap is returned to the OS (malloc_trim): its
    proportional share (PSS: a page that n processes map counts 1/n in each; on the host's shm
    transport the ranks map each other's bucket memory) where Linux tells it, else its RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_before_optimizer(wrapped, x) -> int:
    """RSS with the model wrapped and its grads allocated (one backward), before the optimizer:
    `opt_growth` is what building and stepping the optimizer adds from there."""
    wrapped(x).square().mean().backward()
    return rss_trimmed()


def worker(args) -> None:
    import torch

    import nccl_ddp as nd

    torch.set_num_threads(1)
    nd.init_process_group("host")
    rank, world = nd.get_rank(), nd.get_world_size()
    m = model(args)
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(rank))
    if args.mode.startswith("torch_zero"):
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        store = os.path.join(os.path.dirname(args.out), "gloo")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        ours = args.mode == "torch_zero_nd"  # torch's ZeRO over our DDP (its broadcasts on gloo)
        wrapped = nd.DistributedDataParallel(m) if ours else torch.nn.parallel.DistributedDataParallel(m)
        rss0 = _rss_before_optimizer(wrapped, x)
        opt = ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4)
    else:
        zero2 = args.mode.startswith("zero2")
        overlap = args.mode == "zero2_overlap"
        zero = nd.ZeroConfig(stage=2, overlap_param_gather=overlap) if zero2 else None
        wrapped = nd.DistributedDataParallel(m, zero=zero)
        rss0 = _rss_before_optimizer(wrapped, x)
        opt = (
            nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4)  # follows the model
            if args.mode.startswith("zero")
            else torch.optim.AdamW(m.parameters(), lr=1e-4)
        )

    def step() -> None:
        opt.zero_grad()
        wrapped(x).square().mean().backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    nd.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    nd.barrier()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    growth = rss_trimmed() - rss0
    hidden = gather_hidden = -1.0
    if args.mode not in ("torch_zero", "torch_zero_nd") and args.profile_steps:
        from nccl_ddp.profiling import Timeline

        wrapped.reducer.prof = Timeline(rank, timeline=True)
        for _ in range(args.profile_steps):
            step()
        steps = list(wrapped.reducer.prof.steps)
        hidden = 100.0 * sum(s.overlap_s for s in steps) / max(1e-12, sum(s.comm_s for s in steps))
        gather_s = sum(s.gather_s for s in steps)
        if gather_s > 0:
            gather_hidden = 100.0 * sum(s.gather_hidden_s for s in steps) / gather_s
    row = dict(
        world=world,
        mode=args.mode,
        params_M=sum(p.numel() for p in m.parameters()) / 1e6,
        step_ms=ms,
        hidden_pct=hidden,
        gather_hidden_pct=gather_hidden,
        opt_growth=growth,
    )
    if args.mode.startswith("zero2"):
        shard_memory = opt.shard_memory
        reducer = wrapped.reducer
        reduced = shard_memory.nbytes["grad_shards"] + sum(
            o.nbytes for o, g in zip(reducer.sharding.outputs, shard_memory.grads) if o is not g
        )
        # the grad buffers kept across the step: the GradPool (one bucket per dtype; torch's
        # own p.grad tensors are let go after the step), or full-size buckets where kept
        kept = (0 if reducer.memory is None else reducer.memory.nbytes) + (
            0 if reducer.shard_core.pool is None else reducer.shard_core.pool.nbytes
        )
        row.update(
            state=state_bytes(opt._inner),
            master=shard_memory.nbytes["master"],
            reduced=reduced,
            grad_buf=kept,
            total_grads=reduced + kept,
        )
    else:
        grads = (
            tensor_bytes(p.grad for p in m.parameters() if p.grad is not None)
            if args.mode == "torch_zero"
            else wrapped.reducer.memory.nbytes
        )
        widened = opt.shard_memory.nbytes["grad_shards"] if args.mode == "zero1" else 0  # bf16 grads only
        row.update(
            state=state_bytes(opt.optim if args.mode in ("torch_zero", "torch_zero_nd", "zero1") else opt),
            master=opt.shard_memory.nbytes["master"] if args.mode == "zero1" else 0,
            reduced=grads + widened,
            grad_buf=grads,
            total_grads=grads + widened,
        )
    row["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = _gather_rows(nd, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    if args.mode.startswith("torch_zero"):
        import torch.distributed as dist

        dist.destroy_process_group()
    nd.destroy_process_group()


def _gather_rows(nd, row: dict) -> list:
    """Every rank's numbers on rank 0: the slowest step time, the largest byte counts."""
    import numpy as np

    keys = (
        "step_ms",
        "state",
        "master",
        "reduced",
        "grad_buf",
        "total_grads",
        "peak_rss",
        "opt_growth",
        "hidden_pct",
        "gather_hidden_pct",
    )
    mine = np.array([row[k] for k in keys], np.float64)
    nd.all_reduce(mine, op="max")
    return [dict(row, **{k: float(v) for k, v in zip(keys, mine)})]


def median_row(rows: list) -> dict:
    """One mode's jobs as one row: the job of the median step time (the lower middle one for an
    even count; byte counts are the same in every run)."""
    ranked = sorted(rows, key=lambda r: r["step_ms"])
    return ranked[(len(ranked) - 1) // 2]


def table_rows(raw: list) -> list:
    base = {r["world"]: r for r in raw if r["mode"] == "ddp_adamw"}
    peer = {r["world"]: r for r in raw if r["mode"] == "torch_zero"}
    out = []

    def kept(r: dict) -> float:
        return r["state"] + r["master"] + r["reduced"]

    def total(r: dict) -> float:
        return r["state"] + r["master"] + r["total_grads"]

    for r in raw:
        b = base.get(r["world"])
        out.append(
            dict(
                world=r["world"],
                mode=r["mode"],
                params_M=r["params_M"],
                state_MiB=r["state"] / MiB,
                master_MiB=r["master"] / MiB,
                reduced_MiB=r["reduced"] / MiB,
                kept_MiB=kept(r) / MiB,
                kept_vs_ddp="" if b is None else kept(r) / kept(b),
                grad_buf_MiB=r["grad_buf"] / MiB,
                total_MiB=total(r) / MiB,
                total_vs_ddp="" if b is None else total(r) / total(b),
                peak_rss_MiB=r["peak_rss"] / MiB,
                opt_growth_MiB=r["opt_growth"] / MiB,
                step_ms=r["step_ms"],
                ratio="" if b is None else r["step_ms"] / b["step_ms"],
                vs_torch_zero="" if r["world"] not in peer else r["step_ms"] / peer[r["world"]]["step_ms"],
                hidden_pct="" if r["hidden_pct"] < 0 else r["hidden_pct"],
                gather_hidden_pct="" if r["gather_hidden_pct"] < 0 else r["gather_hidden_pct"],
            )
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode:
        worker(args)
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    raw = []
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            runs: dict = {}
            for i in range(max(1, args.rounds)):  # the modes in turn, round after round
                for mode in args.modes.split(","):
                    out = os.path.join(tmp, f"{world}-{mode}-{i}", "row.json")
                    os.makedirs(os.path.dirname(out))
                    rc = run_ranks(__file__, world, argv + ["--mode", mode, "--out", out], args.timeout)
                    if rc != 0:
                        print(f"# world {world} {mode}: the job failed (exit {rc})", file=sys.stderr)
                        return rc
                    with open(out) as f:
                        runs.setdefault(mode, []).extend(json.load(f))
            raw += [median_row(rs) for rs in runs.values()]
    rows = table_rows(raw)
    print(
        f"# bench_zero {date.today()}: {rows[0]['params_M']:.1f}M fp32 params, AdamW, "
        f"batch {args.batch}/rank, {args.steps} steps after {args.warmup}, median of {args.rounds} "
        f"job(s) per mode (modes interleaved); bytes per rank; vs_torch_zero = step / torch_zero's"
    )
    print(format_table(rows, COLUMNS, FORMATS))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"# wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
