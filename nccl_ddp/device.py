"""One device interface, two implementations: "cuda" (CuPy streams and events) and "host" (NumPy,
each stream a worker thread that runs submitted work in order; events are completion flags).

The reducer is written against `Device`, `Stream` and `Event` only and cannot tell which it runs on.
"""
from __future__ import annotations

import abc
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from .errors import CommTimeout, ConfigError, NcclDdpError

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
    align_bytes: int = 16   # alignment of `empty`/`zeros` arrays and of bucket offsets

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

    def __init__(self) -> None:
        self._tls = threading.local()

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


# ---------------------------------------------------------------------------------------------
# cuda (CuPy, imported on first use: `import nccl_ddp.device` needs only NumPy)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise NcclDdpError("the cuda device needs CuPy: pip install 'nccl_ddp[cuda12]' (or "
                           "[cuda13]), or use the host device") from e
    return cupy


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one GPU (never raises)."""
    try:
        cp = _cupy()
        return bool(cp.cuda.is_available()) and cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class CudaEvent(Event):
    """A CUDA event. `synchronize` polls `query()`, so a wait never outlives its timeout."""

    def __init__(self, event: Any) -> None:
        self.event = event   # cupy.cuda.Event

    def query(self) -> bool:
        return bool(self.event.done)

    def synchronize(self, timeout: Optional[float] = None) -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while not self.query():
            if time.monotonic() >= deadline:
                raise CommTimeout(f"CUDA event not reached within {timeout:.1f}s: a kernel or an "
                                  "NCCL collective is stuck (did a peer rank die or skip a "
                                  "collective?)")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)


class CudaStream(Stream):
    """A CuPy stream. `submit` runs `fn` now with this stream (and its device) current, so the
    kernels `fn` launches through CuPy are queued on it."""

    def __init__(self, stream: Any, device_id: int) -> None:
        self.stream = stream   # cupy.cuda.Stream
        self.device_id = device_id

    @property
    def ptr(self) -> int:
        """The raw cudaStream_t (for NCCL calls)."""
        return self.stream.ptr

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        with _cupy().cuda.Device(self.device_id), self.stream:
            fn(*args, **kwargs)

    def record(self) -> CudaEvent:
        cp = _cupy()
        with cp.cuda.Device(self.device_id):
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
        return CudaEvent(ev)

    def wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            with _cupy().cuda.Device(self.device_id):
                self.stream.wait_event(event.event)
        else:
            event.synchronize()   # a host event: only the host can wait for it (bounded)

    def synchronize(self, timeout: Optional[float] = None) -> None:
        self.record().synchronize(timeout)


class RawStream:
    """A raw cudaStream_t handle speaking the CUDA stream protocol (for Stream.from_external)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple:
        return (0, self.ptr)


class CudaDevice(Device):
    """One GPU through CuPy."""

    kind = "cuda"

    def __init__(self, device_id: int = 0) -> None:
        cp = _cupy()
        n = cp.cuda.runtime.getDeviceCount() if cp.cuda.is_available() else 0
        if not 0 <= device_id < n:
            raise ConfigError(f"CUDA device {device_id} does not exist (CuPy sees {n} GPUs); "
                              "check CUDA_VISIBLE_DEVICES and the local rank")
        self.device_id = device_id
        self.xp = cp

    def new_stream(self) -> CudaStream:
        with self.xp.cuda.Device(self.device_id):
            return CudaStream(self.xp.cuda.Stream(non_blocking=True), self.device_id)

    def current_stream(self) -> CudaStream:
        """CuPy's current stream on this device (set it, or use stream_from_external, to match
        the framework's compute stream)."""
        return CudaStream(self.xp.cuda.get_current_stream(self.device_id), self.device_id)

    def stream_from_external(self, obj: Any) -> CudaStream:
        """Wrap a framework's stream: an object with `__cuda_stream__` (torch.cuda.Stream, ...)
        or a raw cudaStream_t pointer (int)."""
        if isinstance(obj, int):
            obj = RawStream(obj)
        elif not hasattr(obj, "__cuda_stream__"):
            raise TypeError(f"expected an object with __cuda_stream__ or a raw stream pointer "
                            f"(int), got {type(obj).__name__}")
        with self.xp.cuda.Device(self.device_id):
            return CudaStream(self.xp.cuda.Stream.from_external(obj), self.device_id)

    def empty(self, n: int, dtype) -> Any:
        with self.xp.cuda.Device(self.device_id):
            return self.xp.empty(n, dtype=dtype)

    def zeros(self, n: int, dtype) -> Any:
        with self.xp.cuda.Device(self.device_id):
            return self.xp.zeros(n, dtype=dtype)


def get_device(kind: Optional[str] = None, local_rank: Optional[int] = None) -> Device:
    """"host" -> HostDevice; "cuda" -> CudaDevice; None -> cuda when CuPy sees a GPU, else host.
    The GPU is `local_rank` (or GPU 0 when each process sees one), CuPy's current one if None."""
    if kind is None:
        kind = "cuda" if cuda_available() else "host"
    if kind == "host":
        return HostDevice()
    if kind != "cuda":
        raise ConfigError(f"unknown device kind {kind!r}; use 'cuda', 'host' or None")
    if not cuda_available():
        raise ConfigError("device 'cuda' asked for, but CuPy is missing or sees no GPU; install "
                          "nccl_ddp[cuda12] on a GPU machine or use the host device")
    cp = _cupy()
    if local_rank is None:
        return CudaDevice(cp.cuda.Device().id)
    n = cp.cuda.runtime.getDeviceCount()
    if local_rank >= n and n == 1:
        local_rank = 0   # one GPU per process (CUDA_VISIBLE_DEVICES set per rank)
    return CudaDevice(local_rank)
