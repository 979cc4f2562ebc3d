"""The cuda device: CuPy streams and events on one GPU. CuPy is imported on first use, so
`import nccl_ddp.device` needs only NumPy."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from typing import Any, Callable, Iterator, Optional

from nccl_ddp.device.base import Device, Event, Stream
from nccl_ddp.errors import CommTimeout, ConfigError, KernelError
from nccl_ddp.job.env import DEFAULT_TIMEOUT

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600  # cudaErrorNotReady: the event's work is still pending


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise ConfigError(
            "the cuda device needs CuPy: pip install 'nccl_ddp[cuda12]' (or [cuda13]), or use the host device"
        ) from e
    return cupy


_DRIVER_LIBS = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


def driver_present() -> bool:
    """Whether a GPU could be here at all: CuPy is already loaded, or the CUDA driver library
    loads. A CPU machine answers no without importing CuPy (which imports ml_dtypes: seconds per
    process), so choosing the host backend costs nothing there. Never raises."""
    if "cupy" in sys.modules:
        return True
    for name in _DRIVER_LIBS:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one GPU (never raises)."""
    if not driver_present():
        return False
    try:
        cp = _cupy()
        return bool(cp.cuda.is_available()) and cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class CudaEvent(Event):
    """A CUDA event. `synchronize` polls `query()`, so a wait never outlives its timeout."""

    def __init__(self, event: Any) -> None:
        self.event = event  # cupy.cuda.Event

    def query(self) -> bool:
        """True once reached. A CUDA error (a faulted kernel) raises KernelError at once: CuPy's
        `Event.done` is `eventQuery(...) == 0` and would read it as "not yet" until the timeout."""
        rt = _cupy().cuda.runtime
        status = int(rt.eventQuery(self.event.ptr))
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        raise KernelError(
            f"CUDA error while waiting for an event: {rt.CUDARuntimeError(status)} "
            f"(status {status}); a kernel or NCCL op on this device faulted and the "
            "CUDA context is unusable: rerun with CUDA_LAUNCH_BLOCKING=1 or under "
            "compute-sanitizer to find it"
        )

    def synchronize(self, timeout: Optional[float] = None) -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while not self.query():
            if time.monotonic() >= deadline:
                raise CommTimeout(
                    f"CUDA event not reached within {timeout:.1f}s: a kernel or an "
                    "NCCL collective is stuck (did a peer rank die or skip a "
                    "collective?)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)


class CudaStream(Stream):
    """A CuPy stream. `submit` runs `fn` now with this stream (and its device) current, so the
    kernels `fn` launches through CuPy are queued on it."""

    def __init__(self, stream: Any, device_id: int) -> None:
        self.stream = stream  # cupy.cuda.Stream
        self.device_id = device_id

    @property
    def ptr(self) -> int:
        """The raw cudaStream_t (for NCCL calls)."""
        return self.stream.ptr

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        with _cupy().cuda.Device(self.device_id), self.stream:
            fn(*args, **kwargs)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        with _cupy().cuda.Device(self.device_id), self.stream:
            yield

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
            event.synchronize()  # a host event: only the host can wait for it (bounded)

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
            raise ConfigError(
                f"CUDA device {device_id} does not exist (CuPy sees {n} GPUs); "
                "check CUDA_VISIBLE_DEVICES and the local rank"
            )
        self.device_id = device_id
        self.xp = cp

    def new_stream(self) -> CudaStream:
        with self.xp.cuda.Device(self.device_id):
            return CudaStream(self.xp.cuda.Stream(non_blocking=True), self.device_id)

    def current_stream(self) -> CudaStream:
        """CuPy's current stream on this device (the adapters make it the framework's compute
        stream)."""
        return CudaStream(self.xp.cuda.get_current_stream(self.device_id), self.device_id)

    def empty(self, n: int, dtype: Any) -> Any:
        with self.xp.cuda.Device(self.device_id):
            return self.xp.empty(n, dtype=dtype)

    def zeros(self, n: int, dtype: Any) -> Any:
        with self.xp.cuda.Device(self.device_id):
            return self.xp.zeros(n, dtype=dtype)
