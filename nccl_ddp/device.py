"""One device interface, two implementations: "cuda" (CuPy streams and events) and "host" (NumPy,
each stream a worker thread that runs submitted work in order; events are completion flags).

The reducer is written against `Device`, `Stream` and `Event` only and cannot tell which it runs on.
"""
from __future__ import annotations

import abc
import queue
import threading
from typing import Any, Callable, Optional

import numpy as np

from .errors import CommTimeout, NcclDdpError

DEFAULT_TIMEOUT = 300.0


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


class Device(abc.ABC):
    """Allocation, streams and the array module for one kind of device."""

    kind: str   # "cuda" | "host"
    xp: Any     # numpy or cupy

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new stream (the comm stream of a reducer or group)."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream the caller's framework computes on now (the compute stream)."""

    def empty(self, n: int, dtype) -> Any:
        return self.xp.empty(n, dtype=dtype)

    def zeros(self, n: int, dtype) -> Any:
        return self.xp.zeros(n, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# host


class HostEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def _set(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not self._done.wait(timeout):
            raise CommTimeout(f"host stream event not reached within {timeout:.1f}s")
        if self.error is not None:
            raise NcclDdpError(f"host stream task failed: {self.error}") from self.error


class HostStream(Stream):
    """A worker thread that runs submitted callables in order, like a CUDA stream.

    The first exception a task raises is kept: later tasks are skipped, and every event recorded
    after it, `synchronize()` and the next `submit()` raise it, so an error is never lost.
    """

    _count = 0

    def __init__(self, name: str = "") -> None:
        HostStream._count += 1
        self.name = name or f"host-stream-{HostStream._count}"
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            if self.error is not None and not isinstance(fn, _Marker):
                continue
            try:
                fn(*args)
            except BaseException as e:  # kept and re-raised to the caller
                if self.error is None:
                    self.error = e

    def _check(self) -> None:
        if self.error is not None:
            raise NcclDdpError(f"{self.name}: a task failed: {self.error}") from self.error

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._check()
        self._queue.put((fn, args))

    def record(self) -> HostEvent:
        ev = HostEvent()
        self._queue.put((_Marker(lambda: ev._set(self.error)), ()))
        return ev

    def wait(self, event: Event) -> None:
        if isinstance(event, HostEvent) and event.query() and event.error is None:
            return
        self._queue.put((lambda: event.synchronize(), ()))

    def synchronize(self, timeout: Optional[float] = None) -> None:
        self.record().synchronize(timeout)
        self._check()

    def close(self) -> None:
        self._queue.put(None)


class _Marker:
    """A task that runs even after an earlier task failed (event completion)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


class HostDevice(Device):
    kind = "host"
    xp = np

    def __init__(self) -> None:
        self._tls = threading.local()

    def new_stream(self) -> HostStream:
        return HostStream()

    def current_stream(self) -> Stream:
        """The calling thread runs its own host work synchronously; its 'stream' is immediate."""
        return _IMMEDIATE


class ImmediateStream(Stream):
    """The host compute stream: work runs at once on the calling thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def record(self) -> HostEvent:
        ev = HostEvent()
        ev._set()
        return ev

    def wait(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        return None


_IMMEDIATE = ImmediateStream()
