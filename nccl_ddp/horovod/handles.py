"""The handles of Horovod's asynchronous ops (`allreduce_async` -> `poll`, `synchronize`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Optional

from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod.negotiation import Entry


class _Pending:
    def __init__(self, entry: Optional[Entry], finish: Callable[[], object]) -> None:
        self.entry, self.finish = entry, finish


_handles: Dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def new_handle(entry: Optional[Entry], finish: Callable[[], object]) -> int:
    """A Horovod handle for a queued op (None: one that already ran); `finish()` waits for it
    and returns the op's output."""
    h = next(_handle_ids)
    _handles[h] = _Pending(entry, finish)
    return h


def poll(handle: int) -> bool:
    """Whether the op has run (ops run once some rank waits on one: synchronize, a blocking op)."""
    pending = _lookup(handle, "poll")
    return pending.entry is None or pending.entry.done.is_set()


def synchronize(handle: int) -> Any:  # noqa: ANN401  (each op's own output: a tensor, a list, a pair)
    pending = _handles.pop(handle, None)
    if pending is None:
        return None  # Horovod's answer for an unknown (or already synchronized) handle
    return pending.finish()


def _lookup(handle: int, where: str) -> _Pending:
    pending = _handles.get(handle)
    if pending is None:
        raise ConfigError(
            f"hvd.{where}: unknown handle {handle!r}; pass the handle an *_async op returned, "
            "before synchronize() consumed it"
        )
    return pending
