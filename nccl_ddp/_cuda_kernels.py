"""CUDA path of `nccl_ddp.kernels`: compiles kernels/bucket.cu with cupy.RawModule (NVRTC, one
module per device), builds the segment table of a pack/unpack call, caches it, and launches ONE
kernel on CuPy's current stream.

Table (see the comment at the top of bucket.cu): every non-empty array is cut into chunks of
`chunk` elements, one warp per chunk. Up to SMALL_MAX arrays the table travels by value as a kernel
parameter (nothing to upload); above, it is uploaded once to device memory (segments + an item
map) and cached by (device, stream, chunk, pointers, sizes, offsets): rebuilt only when a pointer
changes. The upload is stream-ordered on the launch stream, and a table is only ever freed back to
that stream's memory pool, so no launch can read a table that is being overwritten.
"""
from __future__ import annotations

import collections
import io
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .errors import KernelError
from .kernels import (PACK_PAIRS, SCALE_DTYPES, UNPACK_PAIRS, check_flag, check_flat,
                      check_segments, dtype_name, kernel_source_dir)

log = logging.getLogger(__name__)

THREADS = 256                 # kThreads in bucket.cu
WARPS_PER_BLOCK = THREADS // 32
SMALL_MAX = 32                # kSmallMax in bucket.cu
CHUNK_BYTES = 8192            # work per warp item, in bytes of the wider of the two dtypes
TABLE_CACHE_SIZE = 256        # cached device tables (LRU)
COMPILE_OPTIONS = ("-std=c++17",)

C_TYPE = {"float16": "f16_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# Mirrors of the C structs (bucket.cu static_asserts their sizes).
SEG_DTYPE = np.dtype([("ptr", "<u8"), ("off", "<i8"), ("n", "<i8")])
SMALL_DTYPE = np.dtype([("ptr", "<u8", (SMALL_MAX,)), ("off", "<i8", (SMALL_MAX,)),
                        ("n", "<i8", (SMALL_MAX,)), ("first_item", "<i4", (SMALL_MAX + 1,)),
                        ("nseg", "<i4")])


def kernel_name(op: str, pair: tuple, flag: bool, small: bool) -> str:
    """The name expression of one instantiation. op: pack | unpack | scale; pair: (source dtype,
    destination dtype) as the kernel sees them; flag: pack's non-finite check or unpack's
    accumulate."""
    if op == "scale":
        return f"nd_scale<{C_TYPE[pair[0]]}>"
    suffix = "_small" if small else ""
    b = "true" if flag else "false"
    return f"nd_{op}{suffix}<{C_TYPE[pair[0]]}, {C_TYPE[pair[1]]}, {b}>"


def name_expressions() -> list:
    """Every instantiation the module is compiled with."""
    names = []
    for op, pairs in (("pack", PACK_PAIRS), ("unpack", UNPACK_PAIRS)):
        for pair in sorted(pairs):
            for flag in (False, True):
                for small in (False, True):
                    names.append(kernel_name(op, pair, flag, small))
    names += [kernel_name("scale", (t, t), False, False) for t in sorted(SCALE_DTYPES)]
    return names


def chunk_elems(pair: tuple, chunk_bytes: Optional[int] = None) -> int:
    """Elements per warp item: chunk_bytes (default CHUNK_BYTES, read at call time so a benchmark
    can tune it) of the wider dtype, a multiple of 64 elements."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    wide = max(ITEMSIZE[pair[0]], ITEMSIZE[pair[1]])
    return max(64, (chunk_bytes // wide) // 64 * 64)


@dataclass
class Table:
    """The launch table of one (pointers, sizes, offsets, chunk) set."""
    nitems: int
    small: Optional[np.ndarray] = None   # SMALL_DTYPE, shape (1,): passed by value
    segs: Optional[np.ndarray] = None    # SEG_DTYPE, shape (nseg,)
    items: Optional[np.ndarray] = None   # int32, shape (nitems, 2): {segment, chunk}
    device_buf: Any = None               # segs bytes then items bytes, in device memory
    host_buf: Optional[np.ndarray] = None

    @property
    def grid(self) -> int:
        return max(1, -(-self.nitems // WARPS_PER_BLOCK))


def build_table(ptrs: np.ndarray, sizes: np.ndarray, offsets: np.ndarray, chunk: int,
                small_max: int = SMALL_MAX) -> Table:
    """Cut every non-empty segment into chunks; by value when at most `small_max` segments."""
    keep = np.flatnonzero(sizes > 0)
    ptrs, sizes, offsets = ptrs[keep], sizes[keep], offsets[keep]
    counts = -(-sizes // chunk)
    first = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    nitems = int(first[-1])
    if nitems >= 2**31:
        raise KernelError(f"bucket of {int(sizes.sum())} elements needs {nitems} work items "
                          "(limit 2**31 - 1); use smaller buckets")
    if len(keep) <= small_max:
        small = np.zeros(1, dtype=SMALL_DTYPE)
        k = len(keep)
        small["ptr"][0, :k] = ptrs
        small["off"][0, :k] = offsets
        small["n"][0, :k] = sizes
        small["first_item"][0, :k + 1] = first
        small["first_item"][0, k + 1:] = nitems
        small["nseg"][0] = k
        return Table(nitems, small=small)
    segs = np.empty(len(keep), dtype=SEG_DTYPE)
    segs["ptr"], segs["off"], segs["n"] = ptrs, offsets, sizes
    items = np.empty((nitems, 2), dtype=np.int32)
    items[:, 0] = np.repeat(np.arange(len(keep), dtype=np.int32), counts)
    items[:, 1] = np.arange(nitems, dtype=np.int64) - np.repeat(first[:-1], counts)
    return Table(nitems, segs=segs, items=items)


class CudaKernels:
    """Compiled modules (per device), the table cache and launch counters; `cp` is CuPy."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._modules: dict = {}
        self._sm_count: dict = {}
        self._tables: "collections.OrderedDict" = collections.OrderedDict()
        self.stats = collections.Counter()   # launches, memsets, table_builds, table_uploads

    # -- module -------------------------------------------------------------------------------

    def function(self, device_id: int, name: str) -> Any:
        mod = self._modules.get(device_id)
        if mod is None:
            path = kernel_source_dir() / "bucket.cu"
            try:
                mod = self.cp.RawModule(code=path.read_text(), options=COMPILE_OPTIONS,
                                        name_expressions=tuple(name_expressions()))
                out = io.StringIO()
                mod.compile(log_stream=out)
                if out.getvalue().strip():
                    log.warning("compiling %s: %s", path, out.getvalue().strip())
            except Exception as e:
                raise KernelError(f"compiling {path} for device {device_id} failed: {e}; check "
                                  "that the CUDA runtime/NVRTC match the driver") from e
            self._modules[device_id] = mod
        try:
            return mod.get_function(name)
        except Exception as e:
            raise KernelError(f"kernel {name} not found in bucket.cu: {e}") from e

    def _launch(self, device_id: int, name: str, grid: int, args: tuple) -> None:
        fn = self.function(device_id, name)
        try:
            fn((int(grid),), (THREADS,), args)
        except Exception as e:
            raise KernelError(f"launching {name} (grid {grid}) on device {device_id} failed: "
                              f"{e}") from e
        self.stats["launches"] += 1

    # -- tables -------------------------------------------------------------------------------

    def table(self, op: str, arrays: Sequence[Any], bucket: Any, sizes: np.ndarray,
              offsets: np.ndarray, chunk: int) -> Table:
        """The cached launch table for these pointers, building (and uploading) it on a miss."""
        dev = bucket.device.id
        stream = self.cp.cuda.get_current_stream()
        ptrs = np.fromiter((a.data.ptr for a in arrays), dtype=np.uint64, count=len(arrays))
        key = (dev, stream.ptr, chunk, ptrs.tobytes(), sizes.tobytes(), offsets.tobytes())
        tab = self._tables.get(key)
        if tab is not None:
            self._tables.move_to_end(key)
            return tab
        for i, a in enumerate(arrays):
            if a.size and a.device.id != dev:
                raise KernelError(f"{op}: array {i} is on device {a.device.id} but the bucket "
                                  f"is on device {dev}; move it to the bucket's device")
        tab = build_table(ptrs, sizes, offsets, chunk)
        self.stats["table_builds"] += 1
        if tab.small is None:
            host = np.concatenate([tab.segs.view(np.uint8), tab.items.reshape(-1).view(np.uint8)])
            buf = self.cp.empty(host.size, dtype=self.cp.uint8)
            buf.set(host, stream=stream)   # ordered before the launch on the same stream
            tab.device_buf, tab.host_buf = buf, host
            self.stats["table_uploads"] += 1
        self._tables[key] = tab
        while len(self._tables) > TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        return tab

    def clear_cache(self) -> None:
        self._tables.clear()

    def _table_args(self, tab: Table) -> tuple:
        if tab.small is not None:
            return (tab.small,)
        base = tab.device_buf.data.ptr
        return (base, base + tab.segs.nbytes, np.int32(tab.nitems))

    # -- operations ---------------------------------------------------------------------------

    def pack(self, srcs: Sequence[Any], dst: Any, offsets: Sequence[int], scale: float,
             flag: Any) -> None:
        check_flag("pack", flag)
        self._segments("pack", srcs, dst, offsets, PACK_PAIRS, scale, flag is not None, (flag,))

    def unpack(self, dsts: Sequence[Any], src: Any, offsets: Sequence[int], scale: float,
               accumulate: bool) -> None:
        self._segments("unpack", dsts, src, offsets, UNPACK_PAIRS, scale, bool(accumulate), ())

    def _segments(self, op: str, arrays: Sequence[Any], bucket: Any, offsets: Sequence[int],
                  pairs: frozenset, scale: float, variant: bool, tail: tuple) -> None:
        """One pack/unpack launch: validate, find or build the table, launch."""
        sizes, offs, pair = check_segments(op, arrays, bucket, offsets, pairs, op == "pack")
        dev = bucket.device.id
        with self.cp.cuda.Device(dev):
            chunk = chunk_elems(pair)
            tab = self.table(op, arrays, bucket, sizes, offs, chunk)
            if tab.nitems == 0:
                return
            name = kernel_name(op, pair, variant, tab.small is not None)
            args = self._table_args(tab) + (bucket.data.ptr, np.int32(chunk),
                                            np.float64(scale)) + tail
            self._launch(dev, name, tab.grid, args)

    def scale_(self, buf: Any, factor: float) -> None:
        check_flat("scale_", buf, SCALE_DTYPES)
        if buf.size == 0:
            return
        dev = buf.device.id
        with self.cp.cuda.Device(dev):
            t = dtype_name(buf)
            per_block = THREADS * (16 // ITEMSIZE[t])
            grid = min(-(-buf.size // per_block), self._sms(dev) * 16)
            self._launch(dev, kernel_name("scale", (t, t), False, False), grid,
                         (buf.data.ptr, np.int64(buf.size), np.float64(factor)))

    def zero_(self, buf: Any) -> None:
        check_flat("zero_", buf, None)
        if buf.nbytes == 0:
            return
        with self.cp.cuda.Device(buf.device.id):
            stream = self.cp.cuda.get_current_stream()
            self.cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, stream.ptr)
        self.stats["memsets"] += 1

    def _sms(self, dev: int) -> int:
        if dev not in self._sm_count:
            self._sm_count[dev] = int(
                self.cp.cuda.Device(dev).attributes["MultiProcessorCount"])
        return self._sm_count[dev]


_BACKEND: Optional[CudaKernels] = None


def backend() -> CudaKernels:
    """The process-wide CUDA kernel backend (imports CuPy on first use)."""
    global _BACKEND
    if _BACKEND is None:
        try:
            import cupy
        except ImportError as e:
            raise KernelError("the CUDA kernels need CuPy: pip install 'nccl_ddp[cuda12]' (or "
                              "[cuda13]); NumPy arrays use the host path") from e
        _BACKEND = CudaKernels(cupy)
    return _BACKEND
