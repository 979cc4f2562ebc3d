"""torch.distributed on gloo beside ours, for the 2-rank tests that hold our torch DDP to torch's
own (test_torch_groups, _hook_checks, _pickling, _c10d_gloo): start torch as a script does, run
both DDPs, and tear both groups down."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from mp import run_ranks


@contextlib.contextmanager
def beside_torch(rank: int, world: int, store: str, explicit_store: bool = False) -> Iterator[None]:
    """torch.distributed on gloo from `store` (a file:// init method, or with `explicit_store` a
    FileStore passed as store=, as c10d's tests do) for the block; our group, which our DDP
    joins by itself, is destroyed when the block ends, torch's after it."""
    import torch
    import torch.distributed as dist

    import nccl_ddp as nd

    torch.set_num_threads(1)
    if explicit_store:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        yield
        nd.destroy_process_group()
    finally:
        dist.destroy_process_group()


def on_two_ranks(fn: Callable, tmp_path: Any) -> list:
    """`fn(rank, world, store_path)` on 2 ranks; their results in rank order."""
    return run_ranks(fn, 2, str(tmp_path / "store"), timeout=240)


def raised(call: Callable[[], Any]) -> Optional[tuple]:
    """(the exception's class, its message) of what `call()` raised; None when nothing."""
    try:
        call()
    except Exception as e:
        return type(e), str(e)
    return None
