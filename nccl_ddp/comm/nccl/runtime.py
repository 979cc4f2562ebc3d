"""What the NCCL backend needs from CuPy, in one place: availability, the dtype/op tables, the
CUDA/NCCL call surface (`CupyRuntime`, replaced by a fake in tests) and the translation of NCCL and
CUDA failures into our exceptions. CuPy is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterator

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.device.cuda import driver_present
from nccl_ddp.errors import CommError, CommTimeout, ConfigTypeError

log = logging.getLogger(__name__)

NCCL_IN_PROGRESS = 7  # ncclInProgress: CuPy 14.2's NcclError has no name for it (KeyError: 7)
ADVICE = (
    "Rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,COLL narrows it) and check the other "
    "ranks' logs for the first error."
)

# numpy dtype name -> cupy.cuda.nccl attribute; float8: NCCL >= 2.24 enum values CuPy does not name.
_DTYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}
_MOVING = {1: "NCCL_UINT8", 2: "NCCL_FLOAT16", 4: "NCCL_UINT32", 8: "NCCL_UINT64"}  # by itemsize
_FP8 = {"float8_e4m3fn": 10, "float8_e5m2": 11}
_FP8_MIN_VERSION = 22400
_OPS = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PROD: "NCCL_PROD",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.AVG: "NCCL_AVG",
}


def is_available() -> bool:
    """True when CuPy imports, sees a GPU, and loads NCCL. Never raises; never imports CuPy
    where no CUDA driver is installed."""
    if not driver_present():
        return False
    try:
        import warnings

        import cupy

        if not cupy.cuda.is_available() or cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        return bool(nccl.available) and nccl.get_version() > 0
    except Exception:  # any import or driver failure means "not available"
        return False


def nccl_dtype(dtype: Any, lib: Any, reduce: bool = True) -> int:
    """The ncclDataType_t of a NumPy/CuPy dtype; `lib` is `cupy.cuda.nccl` (or a test fake).
    `reduce=False` (broadcast, all-gather: bits only move) also takes a dtype NCCL has no type
    for (bool, int16, uint16, ...) as the unsigned type of its size."""
    name = getattr(dtype, "name", str(dtype))
    if name in _DTYPES and hasattr(lib, _DTYPES[name]):
        return int(getattr(lib, _DTYPES[name]))
    if name in _FP8 and lib.get_version() >= _FP8_MIN_VERSION:
        return _FP8[name]
    size = getattr(dtype, "itemsize", 0)
    if not reduce and size in _MOVING:
        return int(getattr(lib, _MOVING[size]))
    raise ConfigTypeError(
        f"NCCL cannot reduce dtype {name}; use one of "
        f"{sorted(_DTYPES) + sorted(_FP8)} (float8 needs NCCL >= 2.24)"
    )


def nccl_op(op: ReduceOp | str, lib: Any) -> int:
    """The ncclRedOp_t of a ReduceOp (AVG is NCCL's native ncclAvg)."""
    return int(getattr(lib, _OPS[ReduceOp.parse(op)]))


def stream_ptr(stream: Any) -> int:
    """Raw cudaStream_t of a CudaStream / CuPy stream (`.ptr`) or of a `__cuda_stream__` owner."""
    ptr = getattr(stream, "ptr", None)
    if ptr is None and hasattr(stream, "__cuda_stream__"):
        ptr = stream.__cuda_stream__()[1]
    if ptr is None:
        raise ConfigTypeError(f"stream {stream!r} is not a CUDA stream (no .ptr or __cuda_stream__)")
    return int(ptr)


class CupyRuntime:
    """Every CUDA/NCCL call the group makes, on one device. Tests replace it with a fake."""

    def __init__(self, device_id: int) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.lib, self.device_id = cupy, nccl, device_id
        self.errors: tuple = (nccl.NcclError, cupy.cuda.runtime.CUDARuntimeError)

    def _device(self) -> Any:
        return self.cupy.cuda.Device(self.device_id)

    def unique_id(self) -> bytes:
        return self.lib.get_unique_id()

    def new_comm(self, size: int, uid: bytes, rank: int) -> Any:
        force_blocking_init()
        with self._device():
            return self.lib.NcclCommunicator(size, uid, rank)

    def new_stream(self) -> Any:
        with self._device():
            return self.cupy.cuda.Stream(non_blocking=True)

    def current_stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def record(self, stream: int) -> Any:
        with self._device():
            ev = self.cupy.cuda.Event(disable_timing=True)
        self.cupy.cuda.runtime.eventRecord(ev.ptr, stream)
        return ev

    def wait(self, stream: int, event: Any) -> None:
        self.cupy.cuda.runtime.streamWaitEvent(stream, event.ptr)

    def query(self, event: Any) -> bool:
        """True once reached; a CUDA error raises CUDARuntimeError naming it (CuPy's `Event.done`
        would read a faulted kernel as "not done" until the watchdog's timeout)."""
        rt = self.cupy.cuda.runtime
        status = int(rt.eventQuery(event.ptr))
        if status == 0:
            return True
        if status == 600:  # cudaErrorNotReady
            return False
        raise rt.CUDARuntimeError(status)

    def ptr(self, buf: Any) -> int:
        return buf.data.ptr

    def scratch(self) -> Any:
        with self._device():
            return self.cupy.zeros(1, dtype=self.cupy.float32)

    def bind_thread(self) -> None:
        self._device().use()

    def device_uuid(self) -> str | None:
        """The GPU's UUID (hex), to tell two ranks on one device apart; None if CuPy has none."""
        uuid = self.cupy.cuda.runtime.getDeviceProperties(self.device_id).get("uuid")
        return bytes(uuid).hex() if uuid else None


def force_blocking_init() -> None:
    """Set NCCL_COMM_BLOCKING=1 before a communicator is made: our communicators are blocking.

    With NCCL_COMM_BLOCKING=0 NCCL returns ncclInProgress from init and from collectives, and
    CuPy can neither finish such an init (ncclConfig_t.blocking is not bound; the half-made
    communicator is destroyed when its constructor raises) nor report it (NcclError raises
    KeyError for status 7). NCCL reads the variable once per process, at its first communicator:
    a value read before this runs is reported by `check` instead."""
    old = os.environ.get("NCCL_COMM_BLOCKING")
    if old is not None and old.strip() != "1":
        log.warning(
            "NCCL_COMM_BLOCKING=%s replaced by 1: nccl_ddp's communicators are blocking "
            "(CuPy cannot complete a non-blocking init); the watchdog bounds every op",
            old,
        )
    os.environ["NCCL_COMM_BLOCKING"] = "1"


@contextlib.contextmanager
def check(errors: tuple, what: str) -> Iterator[None]:
    """The one place NCCL and CUDA failures (CuPy raises them) become our exceptions."""
    try:
        yield
    except errors as e:
        raise CommError(f"NCCL {what} failed: {e}. {ADVICE}") from e
    except KeyError as e:  # CuPy's NcclError(7) looks its name up in a table without 7
        if e.args != (NCCL_IN_PROGRESS,):
            raise
        raise CommError(
            f"NCCL {what} returned ncclInProgress (7): the communicator is non-blocking "
            f"(NCCL_COMM_BLOCKING=0 or NCCL_CONF_FILE, read by NCCL before nccl_ddp set "
            f"NCCL_COMM_BLOCKING=1: another library made a communicator first?), which CuPy "
            f"cannot drive; unset NCCL_COMM_BLOCKING in the job's environment. {ADVICE}"
        ) from e


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run a blocking NCCL call (communicator init/split) with a time bound: on timeout the call is
    left behind on a daemon thread and CommTimeout is raised."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="nccl_ddp-init")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise CommTimeout(
            f"{what} did not finish within {timeout:g}s: some rank of the group has "
            f"not joined (crashed, or called a different collective). {ADVICE}"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
