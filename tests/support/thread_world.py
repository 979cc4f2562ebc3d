"""Ranks as threads of this process: torch's "threaded" test world (torch.testing's
multi_threaded_pg), where every rank's torch.distributed world is its thread's."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List


def thread_world(fn: Callable[[int], Any], world: int, timeout: float = 120.0) -> List[Any]:
    """`fn(rank)` on `world` threads, each rank of a torch "threaded" world; their results in rank
    order (an exception is re-raised, naming its rank)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    c10d = torch._C._distributed_c10d
    c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    out: List[Any] = [None] * world

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            out[rank] = ("ok", fn(rank))
        except BaseException as e:
            out[rank] = ("error", e)
            mtpg.ProcessLocalGroup.exception_handle(e)  # wakes the ranks blocked on this one
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(world)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"{stuck} did not finish within {timeout}s"
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        c10d._set_thread_isolation_mode(False)
    for rank, (how, value) in enumerate(out):
        if how == "error":
            raise AssertionError(f"rank {rank} raised {type(value).__name__}: {value}") from value
    return [value for _, value in out]
