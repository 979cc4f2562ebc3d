"""Cost of NCCL_DDP_DEBUG=DETAIL: the cross-rank fingerprint check added before each collective.

    python scripts/bench_desync.py [--worlds 2 4] [--calls 300]

Runs `DesyncChecker.check` (what every NCCL collective does first in DETAIL mode) in N processes
against a real store (rank 0 hosts it, as without the launcher) and reports the added latency per
collective; no GPU is involved, so this is the overhead on top of whatever NCCL takes.
Writes out/bench_desync.csv.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402


def _rank(rank: int, world: int, calls: int, env: dict, out) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    import numpy as np

    from nccl_ddp.comm.desync import DesyncChecker
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import connect_store

    store = connect_store(resolve_env(), timeout=60)
    try:
        check = DesyncChecker(store, rank, range(world), "world", 60.0)
        for _ in range(20):
            check.check("all_reduce", np.dtype(np.float32), 1 << 20, redop="sum")
        store.barrier("start", world, 60)
        t0 = time.perf_counter()
        for _ in range(calls):
            check.check("all_reduce", np.dtype(np.float32), 1 << 20, redop="sum")
        out.put((rank, (time.perf_counter() - t0) / calls))
        store.barrier("end", world, 60)
    finally:
        store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in a.worlds:
        env = {
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "NCCL_DDP_SECRET": secrets.token_hex(8),
        }
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, a.calls, env, out)) for r in range(world)]
        for proc in procs:
            proc.start()
        per_call = [out.get(timeout=300)[1] for _ in procs]
        for proc in procs:
            proc.join(30)
        rows.append(
            {
                "world": world,
                "calls": a.calls,
                "us_per_collective_mean": 1e6 * sum(per_call) / world,
                "us_per_collective_max": 1e6 * max(per_call),
            }
        )
    print(
        format_table(
            rows,
            ["world", "calls", "us_per_collective_mean", "us_per_collective_max"],
            {"us_per_collective_mean": ".0f", "us_per_collective_max": ".0f"},
        )
    )
    os.makedirs("out", exist_ok=True)
    write_csv(rows, "out/bench_desync.csv")


if __name__ == "__main__":
    main()
