"""The host device: NumPy arrays; each stream is a worker thread that runs submitted work in
order (like a CUDA stream), events are completion flags."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import numpy as np

from nccl_ddp.device.base import DEFAULT_TIMEOUT, Device, Event, Stream
from nccl_ddp.errors import CommTimeout, NcclDdpError


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
            _reraise(self.error, "host stream task failed")


def _reraise(error: BaseException, head: str) -> None:
    """Raise a host task's error in the waiting thread: our own errors as they are (a failed
    collective stays a `CommError` naming its op, bucket and rank), anything else wrapped."""
    if isinstance(error, NcclDdpError):
        raise error
    raise NcclDdpError(f"{head}: {error}") from error


class HostStream(Stream):
    """A worker thread that runs submitted callables in order, like a CUDA stream.

    The first exception a task raises is kept: later tasks are skipped, and every event recorded
    after it, `synchronize()` and the next `submit()` raise it, so an error is never lost.
    """

    _count = 0

    def __init__(self, name: str = "") -> None:
        HostStream._count += 1
        self.name = name or f"host-stream-{HostStream._count}"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
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
            _reraise(self.error, f"{self.name}: a task failed")

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
    align_bytes = 64   # JAX on the CPU aliases DLPack memory only at 64-byte aligned addresses

    def empty(self, n: int, dtype) -> np.ndarray:
        return aligned_empty(n, dtype, self.align_bytes)

    def zeros(self, n: int, dtype) -> np.ndarray:
        out = aligned_empty(n, dtype, self.align_bytes)
        out.fill(0)
        return out

    def new_stream(self) -> HostStream:
        return HostStream()

    def current_stream(self) -> Stream:
        """The calling thread runs its own host work synchronously; its 'stream' is immediate."""
        return _IMMEDIATE


def aligned_empty(n: int, dtype, align: int) -> np.ndarray:
    """`np.empty(n, dtype)` starting at an `align`-byte boundary: a view into a slightly larger
    byte buffer, which the view keeps alive through its `.base`."""
    nbytes = n * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype)


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
