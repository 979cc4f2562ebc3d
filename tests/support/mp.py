"""Run a function on N ranks in N fresh processes, with a hard time bound and nothing left behind.

`run_ranks(fn, world_size, *args, timeout=60, env=None)` starts N spawned processes with the
launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
NCCL_DDP_SECRET), calls `fn(rank, world_size, *args)` in each, and returns the list of results in
rank order. When ranks fail, the test fails naming the root cause first, as the launcher does
(`nccl_ddp.launch.supervisor.order_failures`: a rank that failed for a reason of its own, or
died, before the ranks whose errors blame a peer), then the ranks that failed because of it, each
with its traceback. A run that exceeds `timeout` kills every process and fails naming the ranks
that had not finished. `fn` must be importable (a module-level function in a test module).

The ranks are forked from a multiprocessing forkserver that has imported pytest, NumPy, nccl_ddp,
ml_dtypes and torch once per pytest run (where installed), so a rank starts in milliseconds instead
of paying those imports (3-8 s on 2 cores with torch): each is still a new process with its own
state, this process's environment at the call and its sys.path. `fresh=True` spawns interpreters
that have imported nothing, for tests of what a job imports.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from nccl_ddp.job.failure_record import FailureRecord
from nccl_ddp.launch.supervisor import order_failures

# the launcher's variables run_ranks sets in every rank (a test of a script that starts with
# none of them drops these)
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_DDP_SECRET",
)
GRACE = 5.0  # seconds to collect the other ranks' failures after the first one
# what the forkserver imports before it forks ranks (a name that is not installed is skipped)
PRELOAD = ["pytest", "numpy", "ml_dtypes", "torch", "nccl_ddp", "nccl_ddp.comm.host.backend", "nccl_ddp.ddp"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, args, env, results):
    os.environ.clear()  # a forkserver's child starts with the server's environment
    os.environ.update(env)
    try:
        results.put((rank, True, fn(rank, world_size, *args), None))
    except BaseException as e:
        results.put((rank, False, traceback.format_exc(), FailureRecord.of(e, rank)))


def outcome(fn):
    """('ok', value) or (exception class name, message): what a rank saw, for the test to assert on."""
    try:
        return "ok", fn()
    except Exception as e:  # the test asserts on it
        return type(e).__name__, str(e)


class RankFailed(AssertionError):
    pass


@dataclass
class _Failure:
    """One failed rank, shaped like the launcher's Worker for `order_failures`."""

    rank: int
    text: str  # the traceback, or how the process ended
    rec: Optional[FailureRecord] = None  # the failure record the rank sent (None: it died)
    exit_time: float = 0.0

    def record(self) -> Optional[FailureRecord]:
        return self.rec


def error_of(fn) -> str:
    """`fn()`'s exception as "Type: message" (what a rank reports back for the test to assert on),
    or "no error"."""
    try:
        fn()
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"process killed by signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"process exited with code {code}"


def blame_report(failed: dict) -> str:
    """The failures, root cause first (the launcher's order), each with its traceback."""
    ordered = order_failures(list(failed.values()))
    root, then = ordered[0], ordered[1:]
    text = f"rank {root.rank} failed (root cause"
    text += f"; then ranks {[f.rank for f in then]})" if then else ")"
    text += f":\n{root.text}"
    for f in then:
        blames = f.rec.blames if f.rec else None
        text += (
            f"\n--- then rank {f.rank}"
            + (f" [blames rank {blames}]" if blames is not None else "")
            + f":\n{f.text}"
        )
    return text


def _context(fresh: bool):
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first call)
    return ctx


def start_forkserver() -> None:
    """Start the forkserver now; its imports run in the background until the first `run_ranks`
    (tests/conftest.py calls this once the selected tests are known to use it)."""
    from multiprocessing import forkserver

    _context(False)
    forkserver.ensure_running()


def run_ranks(fn, world_size, *args, timeout=60.0, env=None, expect_fail=False, fresh=False):
    """Returns results in rank order; with expect_fail=True returns {rank: traceback} of failures.
    fresh=True: spawned interpreters that import only what `fn` needs."""
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    base = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NCCL_DDP_SECRET": secrets.token_hex(16),
    }
    base.update(env or {})
    procs = []
    for r in range(world_size):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        p = ctx.Process(target=_child, args=(fn, r, world_size, args, e, results), daemon=True)
        p.start()
        procs.append(p)
    out: dict = {}
    failed: dict = {}
    deadline = time.monotonic() + timeout
    grace_end: Optional[float] = None  # after the first failure: the others' reasons
    try:
        while len(out) + len(failed) < world_size:
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            if now >= deadline:
                missing = sorted(set(range(world_size)) - set(out) - set(failed))
                raise RankFailed(
                    f"timed out after {timeout}s; ranks {missing} did not finish"
                    + (f"; failures so far: {blame_report(failed)}" if failed else "")
                )
            try:
                rank, ok, val, rec = results.get(timeout=min(deadline - now, 0.5))
            except queue.Empty:
                _collect_dead(procs, results, out, failed)
            else:
                if ok:
                    out[rank] = val
                else:
                    failed[rank] = _Failure(rank, val, rec)
            if failed and grace_end is None:
                grace_end = time.monotonic() + GRACE
    finally:
        for p in procs:
            p.join(timeout=0.5 if failed else 5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if expect_fail:
        return {r: f.text for r, f in failed.items()}
    if failed:
        unfinished = sorted(set(range(world_size)) - set(out) - set(failed))
        raise RankFailed(
            blame_report(failed)
            + (f"\n--- ranks {unfinished} had not finished {GRACE:g}s later (killed)" if unfinished else "")
        )
    return [out[r] for r in range(world_size)]


def _collect_dead(procs, results, out: dict, failed: dict) -> None:
    """Ranks whose process ended without reporting (os._exit, a signal) fail with their exit."""
    dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out and r not in failed]
    for r in dead:
        time.sleep(0.2)  # a report it made may still be in the queue's pipe
        try:
            while True:
                rk, ok, val, rec = results.get_nowait()
                if ok:
                    out[rk] = val
                else:
                    failed[rk] = _Failure(rk, val, rec)
        except queue.Empty:
            pass
        if r not in out and r not in failed:
            failed[r] = _Failure(r, _exit_text(procs[r].exitcode), None, time.time())
