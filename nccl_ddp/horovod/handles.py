"""The handles of Horovod's asynchronous ops (`allreduce_async` -> `poll`, `synchronize`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict

from nccl_ddp.errors import ConfigError


class _Pending:
    def __init__(self, work: Any, finish: Callable[[], Any]) -> None:
        self.work, self.finish = work, finish


_handles: Dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def new_handle(work: Any, finish: Callable[[], Any]) -> int:
    """A Horovod handle for `work` (a Work, or None when the op already ran); `finish()` waits
    for it and returns the op's output."""
    h = next(_handle_ids)
    _handles[h] = _Pending(work, finish)
    return h


def poll(handle: int) -> bool:
    pending = _lookup(handle, "poll")
    return pending.work is None or bool(pending.work.is_completed())


def synchronize(handle: int) -> Any:
    pending = _handles.pop(handle, None)
    if pending is None:
        return None  # Horovod's answer for an unknown (or already synchronized) handle
    return pending.finish()


def _lookup(handle: Any, where: str) -> _Pending:
    pending = _handles.get(handle)
    if pending is None:
        raise ConfigError(
            f"hvd.{where}: unknown handle {handle!r}; pass the handle an *_async op returned, "
            "before synchronize() consumed it"
        )
    return pending
