"""CUDA path of `nccl_ddp.kernels`: compiles kernels/bucket.cu + kernels/optim.cu (one translation
unit, `module_source`) with cupy.RawModule (NVRTC, one module per device), builds the launch table
of a pack/unpack call, caches it, and launches ONE kernel on CuPy's current stream (the fused
optimizer launches are in `nccl_ddp.kernels.cuda_optim`).

Table (see the comment at the top of bucket.cu): every non-empty array is cut into chunks of
`chunk` elements, one warp per chunk. `choose_chunk` sizes the chunks so that all items fit in the
warps the GPU holds at once (one wave: no tail of late blocks) whenever there are fewer tensors than
resident warps. Up to SMALL_MAX arrays the table travels by value as a kernel parameter (nothing
to upload); above, the pre-chunked items are uploaded once to device memory and cached by (device,
stream, op, dtypes, pointers, sizes, offsets): rebuilt only when a pointer changes. The upload is
stream-ordered on the launch stream. A table leaving the cache is dropped (freed) only once an event
recorded after its last launch is reached: under CuPy's MemoryAsyncPool the buffer is freed with
cudaFreeAsync on the stream it was allocated on only while that stream's Python object lives (a
weak reference), else on whatever stream is current then, and the adapters' streams are
short-lived `Stream.from_external` objects.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp.errors import KernelError
from nccl_ddp.job.env import env_int
from nccl_ddp.kernels.optim_spec import GRAD_DTYPES, PARAM_DTYPES
from nccl_ddp.kernels.spec import (
    PACK_PAIRS,
    SCALE_DTYPES,
    UNPACK_PAIRS,
    check_flag,
    check_flat,
    check_segments,
    dtype_name,
)

log = logging.getLogger(__name__)

THREADS = 256  # kThreads in bucket.cu
WARPS_PER_BLOCK = THREADS // 32
SMALL_MAX = 32  # kSmallMax in bucket.cu
CHUNK_BYTES: Optional[int] = None  # fixed bytes per warp item (of the wider dtype); None: adaptive
MANY_TENSORS_CHUNK_BYTES = 8192  # chunk when there are more tensors than resident warps
MIN_CHUNK = 256  # elements
TABLE_CACHE_SIZE = 256  # cached device tables (LRU)
COMPILE_OPTIONS = ("-std=c++17",)
SOURCES = ("bucket.cu", "optim.cu")  # one module, in this order (optim.cu uses bucket.cu's helpers)

C_TYPE = {"float16": "f16_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# Mirrors of the C structs (bucket.cu static_asserts their sizes).
SEG_DTYPE = np.dtype([("ptr", "<u8"), ("off", "<i8"), ("n", "<i8")])
SMALL_DTYPE = np.dtype(
    [
        ("ptr", "<u8", (SMALL_MAX,)),
        ("off", "<i8", (SMALL_MAX,)),
        ("n", "<i8", (SMALL_MAX,)),
        ("first_item", "<i4", (SMALL_MAX + 1,)),
        ("nseg", "<i4"),
    ]
)


def kernel_source_dir() -> Path:
    """The folder holding the .cu sources: $NCCL_DDP_KERNEL_DIR, else the copy shipped inside the
    installed package (nccl_ddp/_kernels), else the source checkout's top-level kernels/."""
    env = os.environ.get("NCCL_DDP_KERNEL_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "_kernels", here.parent.parent / "kernels"]
    for c in candidates:
        if (c / "bucket.cu").is_file():
            return c
    raise KernelError(
        f"kernel sources (bucket.cu) not found in {', '.join(map(str, candidates))}; reinstall "
        "nccl_ddp or set NCCL_DDP_KERNEL_DIR to the folder holding kernels/bucket.cu"
    )


def module_source() -> str:
    """The text NVRTC compiles: every file of SOURCES, each after a #line naming it."""
    d = kernel_source_dir()
    parts = []
    for name in SOURCES:
        try:
            parts.append(f'#line 1 "{name}"\n' + (d / name).read_text())
        except OSError as e:
            raise KernelError(
                f"kernel source {d / name} unreadable ({e}); reinstall nccl_ddp or "
                "set NCCL_DDP_KERNEL_DIR to the folder holding kernels/*.cu"
            ) from e
    return "\n".join(parts)


def optim_kernel_name(op: str, grad_dtype: str, param_dtype: str) -> str:
    """The name expression of a fused optimizer step: op sgd | adamw."""
    return f"nd_{op}<{C_TYPE[grad_dtype]}, {C_TYPE[param_dtype]}>"


def kernel_name(op: str, pair: tuple, flag: bool, small: bool) -> str:
    """The name expression of one instantiation. op: pack | unpack | scale; pair: (source dtype,
    destination dtype) as the kernel sees them; flag: pack's non-finite check or unpack's
    accumulate (unpack's check is a run-time null or flag pointer)."""
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
    names += [
        optim_kernel_name(op, g, p)
        for op in ("sgd", "adamw")
        for g in sorted(GRAD_DTYPES)
        for p in sorted(PARAM_DTYPES)
    ]
    return names


def choose_chunk(sizes: np.ndarray, pair: tuple, warps: int) -> int:
    """Elements per work item (a multiple of 16, so every chunk keeps the vector alignment).

    With at most `warps` (resident warps) non-empty tensors: the smallest chunk that still gives
    every item its own resident warp, i.e. one wave that spreads the bytes evenly. With more
    tensors there are several waves whatever the chunk: MANY_TENSORS_CHUNK_BYTES per item.
    CHUNK_BYTES, when set, fixes the chunk instead (benchmark sweeps)."""
    wide = max(ITEMSIZE[pair[0]], ITEMSIZE[pair[1]])
    if CHUNK_BYTES is not None:
        return max(16, CHUNK_BYTES // wide // 16 * 16)
    nz = sizes[sizes > 0]
    if nz.size == 0 or nz.size > warps:
        return max(MIN_CHUNK, MANY_TENSORS_CHUNK_BYTES // wide)

    def up16(x: int) -> int:
        return -(-x // 16) * 16

    lo = max(MIN_CHUNK, up16(-(-int(nz.sum()) // warps)))
    hi = max(lo, up16(int(nz.max())))  # one item per tensor: <= warps items
    while lo < hi:  # items(c) = sum(ceil(n / c)) falls as c grows
        mid = up16((lo + hi) // 2)
        if mid >= hi:
            mid = hi - 16
        if mid < lo or int((-(-nz // mid)).sum()) > warps:
            lo = mid + 16
        else:
            hi = mid
    return min(lo, 2**30)


@dataclass
class Table:
    """The launch table of one (pointers, sizes, offsets, chunk) set."""

    nitems: int
    small: Optional[np.ndarray] = None  # SMALL_DTYPE, shape (1,): passed by value
    items: Optional[np.ndarray] = None  # SEG_DTYPE, one per work item (pre-chunked)
    device_buf: Any = None  # `items` in device memory
    used: Any = None  # cupy Event recorded after each launch reading it

    @property
    def grid(self) -> int:
        return max(1, -(-self.nitems // WARPS_PER_BLOCK))


def build_table(
    ptrs: np.ndarray,
    sizes: np.ndarray,
    offsets: np.ndarray,
    chunk: int,
    itemsize: int,
    small_max: int = SMALL_MAX,
) -> Table:
    """Cut every non-empty segment into chunks (`itemsize`: bytes per tensor-side element); by
    value when at most `small_max` segments."""
    keep = np.flatnonzero(sizes > 0)
    ptrs, sizes, offsets = ptrs[keep], sizes[keep], offsets[keep]
    counts = -(-sizes // chunk)
    first = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    nitems = int(first[-1])
    if nitems >= 2**31:
        raise KernelError(
            f"bucket of {int(sizes.sum())} elements needs {nitems} work items "
            "(limit 2**31 - 1); use smaller buckets"
        )
    if len(keep) <= small_max:
        small = np.zeros(1, dtype=SMALL_DTYPE)
        k = len(keep)
        small["ptr"][0, :k] = ptrs
        small["off"][0, :k] = offsets
        small["n"][0, :k] = sizes
        small["first_item"][0, : k + 1] = first
        small["first_item"][0, k + 1 :] = nitems  # unused slots never match an item
        small["nseg"][0] = k
        return Table(nitems, small=small)
    seg = np.repeat(np.arange(len(keep)), counts)
    start = (np.arange(nitems, dtype=np.int64) - np.repeat(first[:-1], counts)) * chunk
    items = np.empty(nitems, dtype=SEG_DTYPE)
    items["ptr"] = ptrs[seg] + (start * itemsize).astype(np.uint64)
    items["off"] = offsets[seg] + start
    items["n"] = np.minimum(sizes[seg] - start, chunk)
    return Table(nitems, items=items)


class CudaKernels:
    """Compiled modules (per device), the table cache and launch counters; `cp` is CuPy."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._modules: dict = {}
        self._functions: dict = {}  # (device, name) -> RawKernel
        self._sm_count: dict = {}
        self._resident: dict = {}
        # NCCL_DDP_SMALL_TABLE_MAX=0 sends every call through the device table (a workaround
        # should passing the table by value ever fail on some CuPy/driver).
        self.small_max = min(SMALL_MAX, env_int("NCCL_DDP_SMALL_TABLE_MAX", SMALL_MAX))
        self._tables: collections.OrderedDict = collections.OrderedDict()
        self._retired: list = []  # tables out of the cache whose last launch may be queued
        # launches, memsets, table_builds, table_uploads
        self.stats: collections.Counter[str] = collections.Counter()

    # -- module -------------------------------------------------------------------------------

    def function(self, device_id: int, name: str) -> Any:
        """The RawKernel `name` on `device_id`, one per (device, name): CuPy's get_function builds
        a new RawKernel (and calls cuModuleGetFunction) on every call."""
        fn = self._functions.get((device_id, name))
        if fn is not None:
            return fn
        mod = self._modules.get(device_id)
        if mod is None:
            path = kernel_source_dir() / " + ".join(SOURCES)
            try:
                mod = self.cp.RawModule(
                    code=module_source(), options=COMPILE_OPTIONS, name_expressions=tuple(name_expressions())
                )
                # No log_stream: CuPy memoizes the module on every argument, log_stream too, and
                # get_function reads it with None: a log stream would load it twice per device.
                # The NVRTC log is checked empty by tests/kernels/test_kernels.py instead.
                mod.compile()
            except Exception as e:
                raise KernelError(
                    f"compiling {path} for device {device_id} failed: {e}; check "
                    "that the CUDA runtime/NVRTC match the driver"
                ) from e
            self._modules[device_id] = mod
        try:
            fn = mod.get_function(name)
        except Exception as e:
            raise KernelError(f"kernel {name} not found in {' + '.join(SOURCES)}: {e}") from e
        self._functions[(device_id, name)] = fn
        return fn

    def _launch(self, device_id: int, name: str, grid: int, args: tuple) -> None:
        fn = self.function(device_id, name)
        try:
            fn((int(grid),), (THREADS,), args)
        except Exception as e:
            raise KernelError(f"launching {name} (grid {grid}) on device {device_id} failed: {e}") from e
        self.stats["launches"] += 1

    # -- tables -------------------------------------------------------------------------------

    def resident_warps(self, device_id: int, name: str) -> int:
        """Warps of kernel `name` the GPU holds at once (occupancy x SMs x warps per block)."""
        key = (device_id, name)
        if key not in self._resident:
            try:
                fn = self.function(device_id, name)
                per_sm = int(
                    self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, THREADS, 0)
                )
            except Exception as e:  # keep working with a safe guess: 2 blocks fit any kernel
                log.warning("occupancy query for %s failed (%s); assuming 2 blocks per SM", name, e)
                per_sm = 2
            self._resident[key] = max(1, per_sm) * self._sms(device_id) * WARPS_PER_BLOCK
        return self._resident[key]

    def table(
        self, op: str, pair: tuple, arrays: Sequence[Any], bucket: Any, sizes: np.ndarray, offsets: np.ndarray
    ) -> tuple:
        """(table, chunk) for these pointers, built (and uploaded) on a miss. `pair`: the
        (source, destination) dtypes of the kernel, as check_segments returns them."""
        dev = bucket.device.id
        stream = self.cp.cuda.get_current_stream()
        ptrs = np.fromiter((a.data.ptr for a in arrays), dtype=np.uint64, count=len(arrays))
        key = (dev, stream.ptr, op, pair, CHUNK_BYTES, ptrs.tobytes(), sizes.tobytes(), offsets.tobytes())
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        self._retire(())
        for i, a in enumerate(arrays):
            if a.size and a.device.id != dev:
                raise KernelError(
                    f"{op}: array {i} is on device {a.device.id} but the bucket "
                    f"is on device {dev}; move it to the bucket's device"
                )
        small = int(np.count_nonzero(sizes)) <= self.small_max
        warps = min(
            self.resident_warps(dev, kernel_name(op, pair, variant, small)) for variant in (False, True)
        )  # the table serves both variants
        chunk = choose_chunk(sizes, pair, warps)
        itemsize = ITEMSIZE[pair[0] if op == "pack" else pair[1]]
        tab = build_table(ptrs, sizes, offsets, chunk, itemsize, self.small_max)
        self.stats["table_builds"] += 1
        if tab.items is not None:
            host = tab.items.view(np.uint8)
            buf = self.cp.empty(host.size, dtype=self.cp.uint8)
            buf.set(host, stream=stream)  # ordered before the launch on the same stream
            tab.device_buf = buf
            tab.used = self.cp.cuda.Event(block=False, disable_timing=True)
            self.stats["table_uploads"] += 1
        hit = (tab, chunk)
        self._tables[key] = hit
        while len(self._tables) > TABLE_CACHE_SIZE:
            self._retire([self._tables.popitem(last=False)[1][0]])
        return hit

    def _retire(self, tables: Sequence[Table]) -> None:
        """Keep the device tables that left the cache until their last launch has run (module
        doc), and drop the ones whose last launch has."""
        self._retired += [t for t in tables if t.device_buf is not None]
        self._retired = [t for t in self._retired if not t.used.done]

    def clear_cache(self) -> None:
        """Forget every table; device tables are freed once their last launch has run."""
        self._retire([hit[0] for hit in self._tables.values()])
        self._tables.clear()

    # -- operations ---------------------------------------------------------------------------

    def pack(self, srcs: Sequence[Any], dst: Any, offsets: Sequence[int], scale: float, flag: Any) -> None:
        check_flag("pack", flag, dst)
        self._segments("pack", srcs, dst, offsets, PACK_PAIRS, scale, flag is not None, flag)

    def unpack(
        self,
        dsts: Sequence[Any],
        src: Any,
        offsets: Sequence[int],
        scale: float,
        accumulate: bool,
        flag: Any = None,
    ) -> None:
        check_flag("unpack", flag, src)
        self._segments("unpack", dsts, src, offsets, UNPACK_PAIRS, scale, bool(accumulate), flag)

    def _segments(
        self,
        op: str,
        arrays: Sequence[Any],
        bucket: Any,
        offsets: Sequence[int],
        pairs: frozenset,
        scale: float,
        variant: bool,
        flag: Any,
    ) -> None:
        """One pack/unpack launch: validate, find or build the table, launch. `flag`: the
        non-finite flag (None: the unchecked instantiation, passed a null pointer)."""
        sizes, offs, pair = check_segments(op, arrays, bucket, offsets, pairs, op == "pack")
        dev = bucket.device.id
        with self.cp.cuda.Device(dev):
            tab, chunk = self.table(op, pair, arrays, bucket, sizes, offs)
            if tab.nitems == 0:
                return
            name = kernel_name(op, pair, variant, tab.small is not None)
            args = self.launch_args(tab, bucket, chunk, scale) + (flag,)
            self._launch(dev, name, tab.grid, args)
            if tab.used is not None:
                tab.used.record()  # on the current stream, after the launch that reads it

    def launch_args(self, tab: Table, bucket: Any, chunk: int, scale: float) -> tuple:
        """The kernel arguments up to `scale` (the flag pointer follows). The SmallTable
        goes by value: CuPy's CNumpyArray hands the launch a pointer to its 904 bytes."""
        head: tuple
        if tab.small is not None:
            by_value = getattr(getattr(self.cp.cuda, "function", None), "CNumpyArray", None)
            head = (by_value(tab.small) if by_value else tab.small,)
        else:
            head = (tab.device_buf, np.int32(tab.nitems))
        return head + (bucket.data.ptr, np.int32(chunk), np.float64(scale))

    def scale_(self, buf: Any, factor: float) -> None:
        check_flat("scale_", buf, SCALE_DTYPES)
        if buf.size == 0:
            return
        dev = buf.device.id
        with self.cp.cuda.Device(dev):
            t = dtype_name(buf)
            per_block = THREADS * (16 // ITEMSIZE[t])
            grid = min(-(-buf.size // per_block), self._sms(dev) * 16)
            self._launch(
                dev,
                kernel_name("scale", (t, t), False, False),
                grid,
                (buf.data.ptr, np.int64(buf.size), np.float64(factor)),
            )

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
            self._sm_count[dev] = int(self.cp.cuda.Device(dev).attributes["MultiProcessorCount"])
        return self._sm_count[dev]


_BACKEND: Optional[CudaKernels] = None


def backend() -> CudaKernels:
    """The process-wide CUDA kernel backend (imports CuPy on first use)."""
    global _BACKEND
    if _BACKEND is None:
        try:
            import cupy
        except ImportError as e:
            raise KernelError(
                "the CUDA kernels need CuPy: pip install 'nccl_ddp[cuda12]' (or "
                "[cuda13]); NumPy arrays use the host path"
            ) from e
        _BACKEND = CudaKernels(cupy)
    return _BACKEND
