"""Run a function on N ranks in N fresh processes, with a hard time bound and nothing left behind.

`run_ranks(fn, world_size, *args, timeout=60, env=None)` starts N spawned processes with the
launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
NCCL_DDP_SECRET), calls `fn(rank, world_size, *args)` in each, and returns the list of results in
rank order. The first rank that raises fails the test with that rank's traceback; a run that
exceeds `timeout` kills every process and fails naming the ranks that had not finished.
`fn` must be importable (a module-level function in a test module).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, args, env, results):
    os.environ.update(env)
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


class RankFailed(AssertionError):
    pass


def run_ranks(fn, world_size, *args, timeout=60.0, env=None, expect_fail=False):
    """Returns results in rank order; with expect_fail=True returns {rank: traceback} of failures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base = {
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "NCCL_DDP_SECRET": secrets.token_hex(16),
    }
    base.update(env or {})
    procs = []
    for r in range(world_size):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        p = ctx.Process(target=_child, args=(fn, r, world_size, args, e, results), daemon=True)
        p.start()
        procs.append(p)
    out, failed = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(failed) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out) - set(failed))
                raise RankFailed(f"timed out after {timeout}s; ranks {missing} did not finish; "
                                 f"failures so far: {failed}")
            try:
                rank, ok, val = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in out and r not in failed]
                for r in dead:  # died without reporting (os._exit, signal)
                    time.sleep(0.2)
                    try:
                        while True:
                            rk, ok2, v2 = results.get_nowait()
                            (out if ok2 else failed)[rk] = v2
                    except queue.Empty:
                        pass
                    if r not in out and r not in failed:
                        failed[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (out if ok else failed)[rank] = val
            if failed and not expect_fail:
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if failed else 5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if expect_fail:
        return failed
    if failed:
        r = min(failed)
        raise RankFailed(f"rank {r} failed:\n{failed[r]}")
    return [out[r] for r in range(world_size)]
