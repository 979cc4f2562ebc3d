"""The device interface the reducer is written against: `Device`, `Stream` and `Event`.

Two implementations: `host` (NumPy, each stream a worker thread) and `cuda` (CuPy streams and events).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, Optional


class Event(abc.ABC):
    """Marks a point in a stream's work."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once everything submitted before the event has finished."""

    @abc.abstractmethod
    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the calling thread until the event; `CommTimeout` after `timeout` seconds."""


class Stream(abc.ABC):
    """An ordered queue of device work."""

    @abc.abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` in stream order. cuda: now, with this stream current, so the kernels it
        launches are queued on the stream; host: later, on the stream's worker thread."""

    @abc.abstractmethod
    def record(self) -> Event:
        """An event that completes when the work submitted so far has finished."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Work submitted after this call starts only after `event` (no host block)."""

    @abc.abstractmethod
    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block until all submitted work has finished; raises what a host task raised."""

    def close(self) -> None:
        """Release what the stream holds (a host stream's worker thread); nothing by default."""

    def awaited(self) -> ContextManager[Any]:
        """Around work the caller submits and then waits for at once (nothing is left to overlap
        with): a host stream that is idle runs it on the calling thread, without two thread
        hand-offs. A CUDA stream queues it."""
        return contextlib.nullcontext()

    def allocating(self) -> ContextManager[Any]:
        """Around allocations whose memory this stream's work uses: a CUDA stream is made
        current, so CuPy's pool ties the memory to it (a block freed there is reused only by
        work queued on it, or freed in its order under the async pool). Nothing on the host."""
        return contextlib.nullcontext()


class Device(abc.ABC):
    """Allocation, streams and the array module for one kind of device."""

    kind: str  # "cuda" | "host"
    xp: Any  # numpy or cupy
    align_bytes: int = 16  # alignment of `empty`/`zeros` arrays and of bucket offsets

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new stream (the comm stream of a reducer or group)."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream the caller's framework computes on now (the compute stream)."""

    def empty(self, n: int, dtype: Any) -> Any:
        return self.xp.empty(n, dtype=dtype)

    def zeros(self, n: int, dtype: Any) -> Any:
        return self.xp.zeros(n, dtype=dtype)
