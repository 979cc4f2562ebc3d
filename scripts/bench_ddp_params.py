"""The --many-params mode of scripts/bench_ddp.py: what a DDP step costs per parameter, ours against
torch DDP's C++ reducer, on a model with many small parameters (where per-hook Python shows).

    python scripts/bench_ddp.py --many-params                 # worlds 1 and 2, quiet
    python scripts/bench_ddp.py --many-params --load          # each world again beside a busy process

Model: a stack of `--linears` Linear(`--width`, `--width`) (2 parameters each), batch `--params-batch`.
One step is forward, MSE loss, backward, SGD, zero_grad. In the same processes, rounds of
`--params-steps` steps each of: no DDP, torch.nn.parallel.DistributedDataParallel (gloo) and ours (host
backend), interleaved so that a change in machine load hits all three alike. Per variant the
median step time (slowest rank); overhead per parameter = (median with DDP - median without) /
parameters. ratio = ours / torch's (below 1: ours costs less). The *_cpu_* columns do the same
with the process's CPU time (every thread: our comm worker, gloo's threads), which a loaded
machine disturbs far less than wall time. Each world is its own job through
nccl-ddp-run; `--load` adds, per world, a run beside one busy process (a Python spin loop), the
competing load of a shared machine. Every row records the 1-minute load average before it ran.
stall_ms: per step, wall time of our step minus the main thread's CPU time in it, minus the
same for the step without DDP: time the training thread spent not running (waiting for the GIL,
for the comm worker at the end of backward, or for a core). *_threads_ms: CPU time per step of
every other thread of the process (our comm stream and group workers; gloo's threads): an upper
bound on the time our workers hold the GIL, which NumPy and socket waits release.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from typing import List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = (
    "world",
    "load",
    "loadavg",
    "params",
    "local_ms",
    "torch_ms",
    "ours_ms",
    "torch_us_per_param",
    "ours_us_per_param",
    "ratio",
    "torch_cpu_us_per_param",
    "ours_cpu_us_per_param",
    "cpu_ratio",
    "stall_ms",
    "torch_threads_ms",
    "ours_threads_ms",
)
FORMATS = {
    "loadavg": ".2f",
    "local_ms": ".2f",
    "torch_ms": ".2f",
    "ours_ms": ".2f",
    "torch_us_per_param": ".1f",
    "ours_us_per_param": ".1f",
    "ratio": ".2f",
    "torch_cpu_us_per_param": ".1f",
    "ours_cpu_us_per_param": ".1f",
    "cpu_ratio": ".2f",
    "stall_ms": ".2f",
    "torch_threads_ms": ".2f",
    "ours_threads_ms": ".2f",
}


def add_args(p) -> None:
    g = p.add_argument_group("--many-params")
    g.add_argument(
        "--many-params",
        action="store_true",
        help="per-parameter overhead, ours vs torch DDP (see bench_ddp_params.py)",
    )
    g.add_argument("--linears", type=int, default=300, help="Linear layers (2 params each)")
    g.add_argument("--width", type=int, default=32)
    g.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    g.add_argument(
        "--rounds", type=int, default=60, help="interleaved rounds of --params-steps steps per variant"
    )
    g.add_argument("--params-steps", type=int, default=1)
    g.add_argument("--load", action="store_true", help="also run each world beside one busy process")
    g.add_argument("--params-csv", default="out/bench_ddp_params.csv")
    g.add_argument("--params-png", default="out/bench_ddp_params.png")
    g.add_argument("--params-batch", type=int, default=8)
    g.add_argument(
        "--find-unused",
        action="store_true",
        help="also both DDPs with find_unused_parameters=True: the used-parameter "
        "bitmap's cost per step (*_fu_ms - *_ms)",
    )
    g.add_argument("--rows-out", default="", help=argparse.SUPPRESS)  # a rank's result file


# ------------------------------------------------------------------------------ inside a rank


def _model(torch, linears: int, width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(linears)])


def measure(nd, args) -> dict:
    """One row: the three variants interleaved, medians over every timed step (slowest rank)."""
    import torch
    import torch.distributed as dist
    from benchlib import init_torch_pg, slowest
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.set_num_threads(1)
    init_torch_pg(nd, torch, "gloo")
    g = torch.Generator().manual_seed(nd.get_rank())
    x = torch.randn(args.params_batch, args.width, generator=g)
    y = torch.randn(args.params_batch, args.width, generator=g)

    def stepper(model, wrapped):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    local = _model(torch, args.linears, args.width)
    theirs = _model(torch, args.linears, args.width)
    mine = _model(torch, args.linears, args.width)
    variants = {
        "local": stepper(local, local),
        "torch": stepper(theirs, TorchDDP(theirs, gradient_as_bucket_view=True)),
        "ours": stepper(mine, nd.DistributedDataParallel(mine)),
    }
    if args.find_unused:
        theirs_fu = _model(torch, args.linears, args.width)
        mine_fu = _model(torch, args.linears, args.width)
        variants["torch_fu"] = stepper(
            theirs_fu, TorchDDP(theirs_fu, gradient_as_bucket_view=True, find_unused_parameters=True)
        )
        variants["ours_fu"] = stepper(
            mine_fu, nd.DistributedDataParallel(mine_fu, find_unused_parameters=True)
        )
    times: dict = {k: [] for k in variants}
    main_cpu: dict = {k: [] for k in variants}  # this (the training) thread's CPU time
    proc_cpu: dict = {k: [] for k in variants}  # all threads', comm workers included
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    for _ in range(args.rounds):
        for name, step in variants.items():
            nd.barrier()
            for _ in range(args.params_steps):
                p0, c0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                step()
                t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
                times[name].append(t1 - t0)
                main_cpu[name].append(c1 - c0)
                proc_cpu[name].append(p1 - p0)

    def median(k, series):  # the slowest rank's median
        return slowest(nd, float(np.median(series[k])))

    def others(k):  # CPU time of every thread but this one, per step
        return slowest(nd, float(np.median(np.subtract(proc_cpu[k], main_cpu[k]))))

    med = {k: median(k, times) for k in times}
    cpu = {k: median(k, proc_cpu) for k in times}
    idle = {k: slowest(nd, float(np.median(np.subtract(times[k], main_cpu[k])))) for k in times}
    n = sum(1 for _ in mine.parameters())
    row = dict(
        world=nd.get_world_size(),
        params=n,
        local_ms=med["local"] * 1e3,
        torch_ms=med["torch"] * 1e3,
        ours_ms=med["ours"] * 1e3,
        torch_us_per_param=(med["torch"] - med["local"]) / n * 1e6,
        ours_us_per_param=(med["ours"] - med["local"]) / n * 1e6,
        torch_cpu_us_per_param=(cpu["torch"] - cpu["local"]) / n * 1e6,
        ours_cpu_us_per_param=(cpu["ours"] - cpu["local"]) / n * 1e6,
        stall_ms=(idle["ours"] - idle["local"]) * 1e3,
        torch_threads_ms=others("torch") * 1e3,
        ours_threads_ms=others("ours") * 1e3,
    )
    if args.find_unused:
        row.update(
            torch_fu_ms=med["torch_fu"] * 1e3,
            ours_fu_ms=med["ours_fu"] * 1e3,
            torch_bitmap_ms=(med["torch_fu"] - med["torch"]) * 1e3,
            ours_bitmap_ms=(med["ours_fu"] - med["ours"]) * 1e3,
        )
    row["ratio"] = row["ours_us_per_param"] / row["torch_us_per_param"]
    row["cpu_ratio"] = row["ours_cpu_us_per_param"] / row["torch_cpu_us_per_param"]
    dist.destroy_process_group()
    return row


def worker(args) -> None:
    import nccl_ddp as nd

    nd.init_process_group(backend="host")
    row = measure(nd, args)
    if nd.get_rank() == 0 and args.rows_out:
        with open(args.rows_out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            w.writeheader()
            w.writerow(row)
    nd.destroy_process_group()


# ------------------------------------------------------------------------------ the driver


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _job(args, argv: List[str], world: int, load: int) -> dict:
    """One world as its own nccl-ddp-run job (beside `load` busy processes); its row."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "row.csv")
        cmd = [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            str(world),
            os.path.join(HERE, "bench_ddp.py"),
            *argv,
            "--rows-out",
            rows,
        ]
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        busy = [_busy() for _ in range(load)]
        try:
            if busy:
                time.sleep(0.5)  # let the busy processes get going
            loadavg = os.getloadavg()[0]
            r = subprocess.run(cmd, timeout=args.timeout, env=env)
        finally:
            for p in busy:
                _stop(p)
        if r.returncode != 0:
            raise SystemExit(f"bench_ddp --many-params: world {world} failed ({r.returncode})")
        with open(rows) as f:
            row = {k: _num(v) for k, v in next(csv.DictReader(f)).items()}
    row.update(load=load, loadavg=loadavg)
    return row


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        return float(v)


def main(args, argv: List[str]) -> int:
    """Not under a launcher: one job per (world, load), then the table, CSV and PNG."""
    from benchlib import format_table, write_csv

    worlds = [int(w) for w in args.worlds.split(",") if w]
    rows = [_job(args, argv, w, load) for load in ([0, 1] if args.load else [0]) for w in worlds]
    print(
        f"# {args.linears} x Linear({args.width}, {args.width}), batch {args.params_batch}, median "
        f"of {args.rounds * args.params_steps} steps per variant (interleaved), slowest rank; "
        f"us_per_param = (DDP step - step without DDP) / params; ratio = ours / torch"
    )
    fu = ("torch_fu_ms", "ours_fu_ms", "torch_bitmap_ms", "ours_bitmap_ms")
    print(
        format_table(
            rows, COLUMNS + (fu if args.find_unused else ()), dict(FORMATS, **{k: ".3f" for k in fu})
        )
    )
    if args.params_csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.params_csv)), exist_ok=True)
        write_csv(rows, args.params_csv)
        print(f"# wrote {args.params_csv}")
    if args.params_png and _plot(rows, args.params_png):
        print(f"# wrote {args.params_png}")
    return 0


def _plot(rows: list, path: str) -> bool:
    """Overhead per parameter against world size, ours and torch's, quiet and under load: wall
    time (left) and process CPU time (right)."""
    from benchlib import plot_panels

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    panels = []
    for kind, label in (("", "wall time"), ("cpu_", "process CPU time")):
        pts = []
        for r in rows:
            when = "quiet" if r["load"] == 0 else f"+{r['load']} busy"
            for who, name in (("torch", "torch DDP"), ("ours", "nccl_ddp")):
                pts.append(
                    dict(world=r["world"], us=r[f"{who}_{kind}us_per_param"], series=f"{name}, {when}")
                )
        panels.append(
            dict(
                rows=pts,
                x="world",
                y="us",
                series="series",
                logx=False,
                title=f"DDP overhead per parameter, {label} ({rows[0]['params']} params)",
                xlabel="world size (ranks)",
                ylabel="us per parameter per step",
            )
        )
    return plot_panels(panels, path)
