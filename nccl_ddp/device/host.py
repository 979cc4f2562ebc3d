"""The host device: NumPy arrays; each stream is a worker thread that runs submitted work in
order (like a CUDA stream), events are completion flags."""

from __future__ import annotations

import _thread
import contextlib
import queue
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np

from nccl_ddp.device.base import Device, Event, Stream
from nccl_ddp.errors import CommError, CommTimeout, NcclDdpError
from nccl_ddp.job.env import DEFAULT_TIMEOUT


class HostEvent(Event):
    """Reached once, by `_set` (with the error of the work before it, if any). A bare lock held
    until then, not a `threading.Event`: a DDP step records several per bucket, and this costs a
    tenth of one to make and to set (the waits are the same: a lock acquire that frees the GIL)."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self.error: Optional[BaseException] = None

    def _set(self, error: Optional[BaseException] = None) -> None:
        if self._lock.locked():  # (reached once: a second call changes nothing)
            self.error = error
            self._lock.release()

    def query(self) -> bool:
        return not self._lock.locked()

    def reached(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; whether the event was reached."""
        if not self._lock.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            return False
        self._lock.release()
        return True

    def synchronize(self, timeout: Optional[float] = None) -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not self.query() and not self.reached(timeout):
            raise CommTimeout(f"host stream event not reached within {timeout:.1f}s")
        if self.error is not None:
            _reraise(self.error, "host stream task failed")


def _reraise(error: BaseException, head: str) -> None:
    """Raise a host task's error in the waiting thread: our own errors as they are (a failed
    collective stays a `CommError` naming its op, bucket and rank), anything else wrapped."""
    if isinstance(error, NcclDdpError):
        raise error
    raise CommError(f"{head}: {error}") from error


class HostStream(Stream):
    """A worker thread that runs submitted callables in order, like a CUDA stream.

    The first exception a task raises is kept: later tasks are skipped, and every event recorded
    after it, `synchronize()` and the next `submit()` raise it, so an error is never lost.
    Inside `awaited()` (the end of a DDP step, which waits at once) work submitted while nothing
    is queued or running runs on the calling thread: the same order, no thread hand-offs.
    """

    _count = 0

    def __init__(self, name: str = "") -> None:
        HostStream._count += 1
        self.name = name or f"host-stream-{HostStream._count}"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: Optional[BaseException] = None
        # queued and finished items: each has one writer (the submitting thread, the worker), so
        # the stream is idle when they are equal, with no lock
        self._queued = self._finished = 0
        self._awaited = False
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                if self.error is None or isinstance(fn, _Marker):
                    fn(*args)
            except BaseException as e:  # kept and re-raised to the caller
                if self.error is None:
                    self.error = e
            finally:
                self._finished += 1

    def _check(self) -> None:
        if self.error is not None:
            _reraise(self.error, f"{self.name}: a task failed")

    def _inline(self) -> bool:
        """Inside `awaited()` with nothing queued or running: run on the calling thread."""
        return self._awaited and self._queued == self._finished

    def _put(self, item: tuple) -> None:
        self._queued += 1
        self._queue.put(item)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` for the worker thread: the thread hop from the caller (a DDP hook,
        `BucketSubmitter.submit`) to this stream; inline inside an idle `awaited()`."""
        self._check()
        if not self._inline():
            self._put((fn, args))
            return
        try:
            fn(*args)
        except BaseException as e:
            self.error = e  # as from the worker: later calls raise it too
            raise

    def record(self) -> HostEvent:
        ev = HostEvent()
        if self._inline():
            ev._set(self.error)
        else:
            self._put((_Marker(lambda: ev._set(self.error)), ()))
        return ev

    @contextlib.contextmanager
    def awaited(self) -> Iterator[None]:
        before, self._awaited = self._awaited, True
        try:
            yield
        finally:
            self._awaited = before

    def wait(self, event: Event) -> None:
        if isinstance(event, HostEvent) and event.query() and event.error is None:
            return
        self._put((lambda: event.synchronize(), ()))

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
    align_bytes = 64  # JAX on the CPU aliases DLPack memory only at 64-byte aligned addresses

    def empty(self, n: int, dtype: Any) -> np.ndarray:
        return aligned_empty(n, dtype, self.align_bytes)

    def zeros(self, n: int, dtype: Any) -> np.ndarray:
        out = aligned_empty(n, dtype, self.align_bytes)
        out.fill(0)
        return out

    def new_stream(self) -> HostStream:
        return HostStream()

    def current_stream(self) -> Stream:
        """The calling thread runs its own host work synchronously; its 'stream' is immediate."""
        return _IMMEDIATE


def aligned_empty(n: int, dtype: Any, align: int) -> np.ndarray:
    """`np.empty(n, dtype)` starting at an `align`-byte boundary: a view into a slightly larger
    byte buffer, which the view keeps alive through its `.base`."""
    nbytes = n * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype)


class ImmediateStream(Stream):
    """The host compute stream: work runs at once on the calling thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def record(self) -> HostEvent:
        return _REACHED  # work on this stream is done when it returns: one shared event

    def wait(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        return None


_REACHED = HostEvent()
_REACHED._set()
_IMMEDIATE = ImmediateStream()
