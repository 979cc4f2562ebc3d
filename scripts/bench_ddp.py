#!/usr/bin/env python
"""Step time of the MLP of examples/train_mlp.py with and without DistributedDataParallel, and the
share of the communication hidden behind backward, for a few bucket sizes (same processes).

    python scripts/bench_ddp.py                       # starts 2 ranks through nccl-ddp-run
                                                      # (one BLAS thread per rank unless set)
    python scripts/bench_ddp.py --nranks 3 --hidden 1024 --layers 6 --caps 0.25,1,4,25
    nccl-ddp-run --nproc-per-node 2 scripts/bench_ddp.py --modes arrays

Per bucket cap: local_ms (the same step without DDP), ddp_ms (hooks per layer, communication
overlapping backward), overhead_ms = ddp_ms - local_ms; then a few more steps with the reducer's
timeline on (nccl_ddp.profiling): comm_ms (union of pack/all-reduce/unpack) and hidden_pct, the part
of it that ran before backward ended. Times are the slowest rank's mean. Rank 0 prints the table
and writes the CSV. Modes are entries of RUNNERS (each returns one dict per cap): add one for
another framework without touching the rest.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Dict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import bench_ddp_params  # noqa: E402
import train_mlp as mlp  # noqa: E402
from benchlib import (  # noqa: E402
    Progress,
    format_table,
    our_hook,
    plot_panels,
    run_ranks,
    sent_mib,
    slowest,
    synchronize,
    timed_steps,
    write_csv,
)

COLUMNS = (
    "mode",
    "hook",
    "ranks",
    "backend",
    "params_MiB",
    "cap_MiB",
    "buckets",
    "local_ms",
    "ddp_ms",
    "overhead_ms",
    "comm_ms",
    "hidden_pct",
    "sent_MiB",
    "torch_ddp_ms",
    "torch_sent_MiB",
    "ratio",
    "lockstep_ms",
    "allreduce_ms",
    "limit_ms",
    "vs_limit",
    "torch_vs_limit",
    "backward_ms",
    "exposed_ms",
    "threads_cpu_ms",
    "stall_ms",
)
FORMATS = {
    "params_MiB": ".2f",
    "local_ms": ".2f",
    "ddp_ms": ".2f",
    "overhead_ms": ".2f",
    "comm_ms": ".2f",
    "hidden_pct": ".0f",
    "sent_MiB": ".3f",
    "torch_ddp_ms": ".2f",
    "torch_sent_MiB": ".3f",
    "ratio": ".2f",
    "lockstep_ms": ".2f",
    "allreduce_ms": ".2f",
    "limit_ms": ".2f",
    "vs_limit": ".2f",
    "torch_vs_limit": ".2f",
    "backward_ms": ".2f",
    "exposed_ms": ".2f",
    "threads_cpu_ms": ".2f",
    "stall_ms": ".2f",
}
HOOKS = ("allreduce", "bf16", "fp16", "powersgd")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--caps", default="0.25,1,4,25", help="bucket caps in MiB, comma-separated")
    p.add_argument("--modes", default="arrays", help=f"comma-separated, of {sorted(RUNNERS)}")
    p.add_argument(
        "--torch",
        action="store_true",
        help="add mode torch: our DDP vs torch DDP on the same model (ratio = ours/torch)",
    )
    p.add_argument(
        "--hook",
        default="allreduce",
        help=f"comm hooks, comma-separated, of {HOOKS} (torch mode: torch DDP gets the matching torch hook)",
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step-rounds", type=int, default=3, help="torch mode: interleaved rounds (medians)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps with the timeline on")
    p.add_argument("--nranks", type=int, default=2, help="ranks to start without a launcher")
    p.add_argument("--csv", default="out/bench_ddp.csv", help="CSV path ('' for none)")
    p.add_argument(
        "--png",
        default="out/bench_ddp.png",
        help="step time and hidden share against bucket cap ('' for none)",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    bench_ddp_params.add_args(p)
    return p.parse_args(argv)


def _timed(nd, xp, step: Callable[[], None], args) -> float:
    return timed_steps(nd, step, args.warmup, args.steps, lambda: synchronize(xp))


def run_arrays(nd, xp, args, cap_mb: float, hook: str = "allreduce") -> dict:
    """The raw-array MLP (hand-written backprop, a DDP hook per parameter, plain SGD)."""
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.profiling import Timeline

    rank = nd.get_rank()
    dims = [args.features] + [args.hidden] * args.layers + [1]
    rng = np.random.default_rng(rank)
    x = xp.asarray(rng.standard_normal((args.batch, args.features)), dtype=xp.float32)
    y = xp.asarray(rng.standard_normal((args.batch, 1)), dtype=xp.float32)
    lr = 1e-4

    def train_step(params, grads_of, hooks, call, zero):
        acts = call(x)
        err = acts[-1] - y
        mlp.backward(params, acts, 2.0 * err / err.size, hooks)
        for k in params:
            params[k] -= lr * grads_of(k)
        zero()

    local = mlp.init_params(xp, dims, 0)
    local_grads: dict = {}
    local_hooks = {k: functools.partial(local_grads.__setitem__, k) for k in local}
    t_local = _timed(
        nd,
        xp,
        lambda: train_step(
            local, local_grads.__getitem__, local_hooks, lambda v: mlp.forward(local, v), lambda: None
        ),
        args,
    )

    model = ArrayModule(mlp.init_params(xp, dims, 0), forward=mlp.forward)
    ddp = nd.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    state = our_hook(nd, ddp, hook)
    hooks = {k: ddp.grad_hook(k) for k in model.keys}

    def ddp_step():
        train_step(model.params, model.grads.__getitem__, hooks, ddp, ddp.zero_grad)

    t_ddp = _timed(nd, xp, ddp_step, args)
    ddp.reducer.prof = Timeline(rank, timeline=True)
    before = state.total_numel_after_compression if state else 0
    for _ in range(args.profile_steps):
        ddp_step()
    steps = list(ddp.reducer.prof.steps)
    comm = sum(s.comm_s for s in steps) / max(1, len(steps))
    hidden = sum(s.overlap_s for s in steps) / max(1e-12, sum(s.comm_s for s in steps))
    nbytes = sum(b.nbytes for b in ddp.reducer.layout.buckets)
    row = dict(
        mode="arrays",
        hook=hook,
        ranks=nd.get_world_size(),
        backend=nd.get_world_group().backend,
        sent_MiB=sent_mib(ddp.reducer.layout.buckets, hook, state, before, args.profile_steps),
        params_MiB=nbytes / 2**20,
        cap_MiB=cap_mb,
        buckets=len(ddp.reducer.layout.buckets),
        local_ms=t_local * 1e3,
        ddp_ms=t_ddp * 1e3,
        overhead_ms=(t_ddp - t_local) * 1e3,
        comm_ms=slowest(nd, comm) * 1e3,
        hidden_pct=100.0 * hidden,
    )
    ddp.close()
    return row


def run_torch(nd, xp, args, cap_mb: float, hook: str = "allreduce") -> dict:
    """PyTorch MLP: ours vs torch.nn.parallel.DistributedDataParallel (scripts/bench_ddp_torch.py)."""
    from bench_ddp_torch import run_torch as run

    return run(nd, xp, args, cap_mb, hook)


RUNNERS: Dict[str, Callable] = {"arrays": run_arrays, "torch": run_torch}


def worker(args) -> list:
    import nccl_ddp as nd

    group = nd.init_process_group()
    if group.backend == "nccl":
        import cupy as xp

        xp.cuda.Device(group.device_id).use()  # the GPU the NCCL group runs on
    else:
        xp = np
    rank = nd.get_rank()
    modes = [m for m in args.modes.split(",") if m] + (["torch"] if args.torch else [])
    unknown = [m for m in modes if m not in RUNNERS]
    if unknown:
        raise SystemExit(f"bench_ddp: unknown mode(s) {unknown}; choose from {sorted(RUNNERS)}")
    caps = [float(c) for c in args.caps.split(",") if c]
    hooks = [h for h in args.hook.split(",") if h]
    if any(h not in HOOKS for h in hooks):
        raise SystemExit(f"bench_ddp: unknown hook(s) in {hooks}; choose from {HOOKS}")
    prog = Progress(len(caps) * len(modes) * len(hooks), "bench_ddp") if rank == 0 else None
    rows = []
    for mode in modes:
        for hook in hooks:
            for cap in caps:
                rows.append(RUNNERS[mode](nd, xp, args, cap, hook))
                if prog:
                    prog.step(f"{mode} {hook} cap {cap} MiB")
    if prog:
        prog.close()
    if rank == 0:
        print(
            f"# MLP {args.features}-{'x'.join([str(args.hidden)] * args.layers)}-1, batch "
            f"{args.batch} per rank; slowest rank's mean over {args.steps} steps"
        )
        print(format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)], FORMATS))
        if args.csv:
            os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
            write_csv(rows, args.csv)
            print(f"# wrote {args.csv}")
        if args.png and rows and _plot(rows, args.png):
            print(f"# wrote {args.png}")
    nd.destroy_process_group()
    return rows


def _plot(rows: list, path: str) -> bool:
    """Left: step time against bucket cap (no DDP, ours, torch DDP); right: comm hidden (%)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    times, hidden = [], []
    for r in rows:
        cap, mode = r["cap_MiB"], f"{r['mode']} {r['hook']}"
        times.append(dict(cap=cap, ms=r["local_ms"], series=f"{mode}: no DDP"))
        times.append(dict(cap=cap, ms=r["ddp_ms"], series=f"{mode}: nccl_ddp DDP"))
        if r.get("torch_ddp_ms") is not None:
            times.append(dict(cap=cap, ms=r["torch_ddp_ms"], series=f"{mode}: torch DDP"))
        hidden.append(dict(cap=cap, pct=r["hidden_pct"], series=mode))
    title = f"{rows[0]['ranks']} ranks, {rows[0]['backend']} backend"
    return plot_panels(
        [
            dict(
                rows=times,
                x="cap",
                y="ms",
                series="series",
                title=f"step time, {title}",
                xlabel="bucket cap (MiB)",
                ylabel="ms per step",
            ),
            dict(
                rows=hidden,
                x="cap",
                y="pct",
                series="series",
                title="communication hidden behind backward",
                xlabel="bucket cap (MiB)",
                ylabel="% of comm time",
            ),
        ],
        path,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.many_params:
        if "RANK" not in os.environ:  # one job per world size, each through nccl-ddp-run
            return bench_ddp_params.main(args, sys.argv[1:] if argv is None else list(argv))
        bench_ddp_params.worker(args)
        return 0
    if "RANK" not in os.environ:  # not under a launcher: start the ranks through nccl-ddp-run
        return run_ranks(__file__, args.nranks, sys.argv[1:] if argv is None else argv, args.timeout)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
