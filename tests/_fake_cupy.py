"""A fake CuPy for machines without a GPU: arrays live in one byte heap at fake device addresses,
and every kernel launch runs the REAL kernels/bucket.cu, compiled for the CPU (tests/cuda_cpu:
PTX mapped to software of the same semantics, warps as fibers, memcheck/racecheck-like checks),
from the raw arguments the launch path packs, checked like cuLaunchKernel. So the Python launch path
(tables, cache, chunking, argument packing, streams) drives the CUDA code end to end. Where no C++
compiler is available (`CPU_KERNELS_MISSING` says why) launches fall back to executing the NumPy
references on each work item the way bucket.cu reads its tables."""
import re
import struct
import types
import weakref

import numpy as np

from nccl_ddp import kernels as K
from nccl_ddp.kernels import cuda as ck

BASE = 0x7F00_0000_0000   # device addresses when the kernels run as references
C_DTYPE = {"float": np.dtype(np.float32), "double": np.dtype(np.float64),
           "f16_t": np.dtype(np.float16)}


def _c_dtype(name):
    if name == "bf16_t":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return C_DTYPE[name]


def cpu_kernels():
    """The CPU build of the real kernels/bucket.cu (cached), or None (see CPU_KERNELS_MISSING)."""
    global CPU_KERNELS_MISSING
    if CPU_KERNELS_MISSING is not None:
        return None
    try:
        from cuda_cpu import runtime
        if runtime.compiler() is None:
            CPU_KERNELS_MISSING = "no C++ compiler (g++ or clang++) to build kernels/bucket.cu"
            return None
        src = (ck.kernel_source_dir() / "bucket.cu").read_text()
        return runtime.load(src, ck.name_expressions(),
                            runtime.effective_ftz(cupy_nvrtc_options(ck.COMPILE_OPTIONS)))
    except Exception as e:   # a build failure is a test failure: report it, do not fall back
        raise RuntimeError(f"building kernels/bucket.cu for the CPU failed: {e}") from e


CPU_KERNELS_MISSING = None


def cupy_nvrtc_options(options, arch="sm_90", nvrtc=(12, 9)):
    """The option list CuPy 14.2 hands NVRTC for RawModule(options=options): `-ftz=true` after
    ours (cupy/cuda/compiler.py _compile_with_cache_cuda), then the arch, then
    --device-as-default-execution-space, and --pch for NVRTC >= 12.8."""
    opts = tuple(options) + ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    if nvrtc >= (12, 8):
        opts += ("--pch",)
    return opts


class Heap:
    def __init__(self, nbytes=256 << 20, cpu=None):
        self.cpu = cpu   # the CPU kernel module, or None
        if cpu is not None:
            self.dev = cpu.new_heap(nbytes)
            self.mem, self.base = self.dev.mem, self.dev.base
        else:
            self.dev = None
            self.mem, self.base = np.zeros(nbytes, np.uint8), BASE
        self.top = 0

    def alloc(self, nbytes, misalign=0):
        off = -(-self.top // 256) * 256 + misalign
        if off + nbytes > self.mem.size:
            raise MemoryError("fake heap full")
        self.top = off + nbytes
        return self.base + off

    def view(self, addr, n, dtype):
        dtype = np.dtype(dtype)
        off = addr - self.base
        assert 0 <= off and off + n * dtype.itemsize <= self.top, "access outside allocations"
        return self.mem[off:off + n * dtype.itemsize].view(dtype)


class Allocation:
    """One device allocation: live (for the kernels' memory checks) while any array uses it."""

    def __init__(self, heap, nbytes, misalign=0):
        self.ptr = heap.alloc(nbytes, misalign)
        if heap.dev is not None and nbytes:
            heap.dev.register(self.ptr, nbytes)
            weakref.finalize(self, heap.dev.unregister, self.ptr)


class FakeArray:
    def __init__(self, cp, addr, shape, dtype, device_id=0, contiguous=True, owner=None):
        self.cp, self.dtype, self.shape = cp, np.dtype(dtype), tuple(shape)
        self.owner = owner   # the Allocation (kept alive by every view of it)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize
                             for i in range(len(self.shape)))
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)
        self.data = FakeMemPtr(cp, addr)
        self.device = types.SimpleNamespace(id=device_id)

    def host(self):
        """A writable NumPy view of the array's bytes in the heap."""
        return self.cp.heap.view(self.data.ptr, self.size, self.dtype).reshape(self.shape)

    def set(self, arr, stream=None):
        self.cp.uploads.append(stream)
        self.host()[...] = arr

    # the little array arithmetic the benchmark script uses (1-D, computed on the host)
    def __getitem__(self, key):
        start, stop, step = key.indices(self.size)
        assert step == 1 and len(self.shape) == 1
        return FakeArray(self.cp, self.data.ptr + start * self.dtype.itemsize,
                         (max(0, stop - start),), self.dtype, self.device.id, owner=self.owner)

    def __setitem__(self, key, value):
        self.host()[key] = value.host() if isinstance(value, FakeArray) else value

    def __mul__(self, other):
        return self.cp.asarray(self.host() * other)

    def astype(self, dtype):
        return self.cp.asarray(self.host().astype(dtype))

    def fill(self, value):
        self.host()[...] = value

    def reshape(self, shape):
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        assert int(np.prod(shape, dtype=np.int64)) == self.size and self.flags.c_contiguous
        return FakeArray(self.cp, self.data.ptr, shape, self.dtype, self.device.id)

    def view(self, dtype):
        dtype = np.dtype(dtype)
        return FakeArray(self.cp, self.data.ptr, (self.nbytes // dtype.itemsize,), dtype,
                         self.device.id, owner=self.owner)

    def get(self):
        return self.host().copy()

    def copy(self):
        return self.cp.asarray(self.host().copy())


class FakeMemPtr:
    def __init__(self, cp, ptr):
        self.cp, self.ptr = cp, ptr

    def copy_from_device_async(self, src, nbytes, stream=None):
        self.cp.heap.view(self.ptr, nbytes, np.uint8)[...] = \
            self.cp.heap.view(src.ptr, nbytes, np.uint8)


class FakeStream:
    _next = 0x5000

    def __init__(self, null=False, non_blocking=False, ptr=None):
        FakeStream._next += 16
        self.ptr = 0 if null else (ptr if ptr is not None else FakeStream._next)
        self.non_blocking = non_blocking
        self.waited = []
        self._prev = []

    def __enter__(self):
        self._prev.append(FAKE_STATE["current"])
        FAKE_STATE["current"] = self
        return self

    def __exit__(self, *exc):
        FAKE_STATE["current"] = self._prev.pop()

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        return None

    @classmethod
    def from_external(cls, obj):
        version, ptr = obj.__cuda_stream__()
        assert version == 0
        s = cls(ptr=ptr)
        s.external = obj
        return s


FAKE_STATE = {"current": FakeStream(null=True)}


class FakeEvent:
    """cupy.cuda.Event; `status` is what cudaEventQuery returns (0 done, 600 not ready, else a
    CUDA error)."""
    _next = 0xE000
    registry: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()   # ptr -> event

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded_on = None
        self.status = 600
        FakeEvent._next += 16
        self.ptr = FakeEvent._next
        FakeEvent.registry[self.ptr] = self

    @property
    def done(self):   # CuPy 14: eventQuery(...) == 0, errors read as "not done"
        return self.status == 0

    @done.setter
    def done(self, value):
        self.status = 0 if value else 600

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        self.status = 0


class FakeCUDARuntimeError(RuntimeError):
    NAMES = {700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
             716: "cudaErrorMisalignedAddress: misaligned address"}

    def __init__(self, status):
        self.status = status
        super().__init__(self.NAMES.get(status, f"cudaError {status}"))


class FakeDeviceCtx:
    def __init__(self, device_id=None):
        self.id = 0 if device_id is None else device_id
        self.attributes = {"MultiProcessorCount": FAKE_STATE.get("sms", 132)}

    def synchronize(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def cupy_arg(a):
    """(bytes, kind, description) of one kernel argument, converted the way CuPy 14 does
    (cupy/_core/_scalar.pyx, cuda/function.pyx): an array is its pointer, None a NULL pointer, a
    Python int an int64 (uint64 from 2**63), a float a double, a NumPy scalar keeps its type, a
    CNumpyArray (or a size-1 structured ndarray) passes its bytes by value."""
    from cuda_cpu.runtime import LaunchError
    if isinstance(a, FakeArray):
        return struct.pack("<Q", a.data.ptr), "pointer", f"a cupy.ndarray of {a.dtype}"
    if a is None:
        return bytes(8), "pointer", "None"
    if isinstance(a, FakeCNumpyArray):
        return a.val.tobytes(), "struct", f"a CNumpyArray of {a.val.dtype}"
    if isinstance(a, np.ndarray):
        if a.size == 1 and a.dtype.names:
            return a.tobytes(), "struct", f"a structured ndarray of {a.dtype}"
        raise LaunchError(f"CuPy cannot pass a NumPy array of shape {a.shape} to a kernel")
    if isinstance(a, (bool, np.bool_)):
        return bytes([bool(a)]), "integer", "bool"
    if isinstance(a, int):
        if -2**63 <= a < 2**63:
            return struct.pack("<q", a), "integer", "a Python int (int64)"
        if 0 <= a < 2**64:
            return struct.pack("<Q", a), "integer", "a Python int (uint64)"
        raise LaunchError(f"Python int {a} does not fit 64 bits")
    if isinstance(a, float):
        return struct.pack("<d", a), "float", "a Python float (double)"
    if isinstance(a, np.generic) and a.dtype.kind in "iuf":
        return a.tobytes(), "float" if a.dtype.kind == "f" else "integer", f"numpy.{a.dtype}"
    raise LaunchError(f"unsupported kernel argument type {type(a).__name__}")


class FakeFunction:
    """A RawKernel of the fake module: runs the CPU build of the kernel when there is one."""

    def __init__(self, cp, name, cpu=None, prefix=""):
        self.cp, self.name, self.cpu = cp, name, cpu
        self.cpu_name = f"{prefix}::{name}" if prefix else name
        self.kernel = types.SimpleNamespace(ptr=hash(name) & 0xFFFF_FFFF)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert len(grid) == 1 and len(block) == 1
        on = (stream or FAKE_STATE["current"]).ptr
        self.cp.launches.append((self.name, grid[0], on))
        if self.cpu is not None:
            self.cpu.launch(self.cp.heap.dev, self.cpu_name, int(grid[0]), int(block[0]),
                            [cupy_arg(a) for a in args])
            return
        assert block == (ck.THREADS,) and grid[0] >= 1
        m = re.fullmatch(r"nd_scale<(\w+)>", self.name)
        if m:
            ptr, n, factor = args
            assert isinstance(n, np.int64) and isinstance(factor, np.float64)
            K.scale_ref(self.cp.heap.view(ptr, int(n), _c_dtype(m.group(1))), float(factor))
            return
        m = re.fullmatch(r"nd_(pack|unpack)(_small)?<(\w+), (\w+), (true|false)>", self.name)
        assert m, self.name
        op, small, ts, td, variant = m.groups()
        ts, td = _c_dtype(ts), _c_dtype(td)
        if small:
            tab, rest = args[0], args[1:]
            assert isinstance(tab, FakeCNumpyArray)   # a pointer to the bytes, as in CuPy
            tab = tab.val
            assert isinstance(tab, np.ndarray) and tab.dtype == ck.SMALL_DTYPE and tab.size == 1
            raw = np.frombuffer(tab.tobytes(), ck.SMALL_DTYPE)[0]   # only the bytes travel
            k, first = int(raw["nseg"]), raw["first_item"]
            nitems = int(first[k])
            segs = [(int(raw["ptr"][t]), int(raw["off"][t]), int(raw["n"][t])) for t in range(k)]

            def find(item):   # bucket.cu SmallTable::find: the last slot whose first <= item
                t = max(s for s in range(ck.SMALL_MAX) if item >= first[s])
                return segs[t], item - int(first[t])
        else:
            items_arr, nitems, rest = args[0], args[1], args[2:]
            assert isinstance(items_arr, FakeArray) and isinstance(nitems, np.int32)
            items = self.cp.heap.view(items_arr.data.ptr, int(nitems), ck.SEG_DTYPE)

            def find(item):   # bucket.cu TableRef::find: one pre-chunked item, j = 0
                s = items[item]
                return (int(s["ptr"]), int(s["off"]), int(s["n"])), 0
        bucket, chunk, scale = rest[:3]
        assert isinstance(chunk, np.int32) and isinstance(scale, np.float64)
        assert grid[0] * ck.WARPS_PER_BLOCK >= int(nitems)
        flag = None
        if op == "pack":
            assert len(rest) == 4 and (rest[3] is not None) == (variant == "true")
            if rest[3] is not None:
                flag = rest[3].host().reshape(-1)[:1]
        heap, chunk = self.cp.heap, int(chunk)
        for item in range(int(nitems)):
            (ptr, off, n), j = find(item)
            start = j * chunk
            length = min(chunk, n - start)
            assert 0 < length <= chunk
            if op == "pack":
                src = heap.view(ptr + start * ts.itemsize, length, ts)
                dst = heap.view(bucket + (off + start) * td.itemsize, length, td)
                K.pack_ref([src], dst, [0], scale=float(scale), nonfinite_flag=flag)
            else:
                src = heap.view(bucket + (off + start) * ts.itemsize, length, ts)
                dst = heap.view(ptr + start * td.itemsize, length, td)
                K.unpack_ref([dst], src, [0], scale=float(scale), accumulate=variant == "true")


class FakeCNumpyArray:
    """cupy.cuda.function.CNumpyArray: passes a NumPy array's bytes by value."""

    def __init__(self, v):
        self.val = v
        self.ptr = v.__array_interface__["data"][0]


class FakeRawModule:
    """cupy.RawModule: with a CPU build, compiles `code` (with the -ftz CuPy's option list
    implies) for the CPU once, at the first compile() or get_function()."""

    def __init__(self, cp, code, options, name_expressions):
        assert "nd_pack" in code and "-std=c++17" in options
        self.cp, self.code, self.options = cp, code, tuple(options)
        self.names = tuple(name_expressions)
        self.module, self.prefix = None, ""

    def _build(self):
        if self.module is None and self.cp.cpu_override is not None:
            self.module, self.prefix = self.cp.cpu_override
        if self.module is None and self.cp.cpu is not None:
            from cuda_cpu import runtime
            names = self.cp.kernel_names or self.names   # a subset: quicker mutant builds
            self.module = runtime.load(self.code, names, runtime.effective_ftz(
                cupy_nvrtc_options(self.options)))

    def compile(self, log_stream=None):
        self.cp.compiles += 1
        self._build()

    def get_function(self, name):
        assert name in self.names, name
        self.cp.get_function_calls += 1
        self._build()
        return FakeFunction(self.cp, name, self.module, self.prefix)


class FakeCupy:
    """The slice of the CuPy API that nccl_ddp.device and nccl_ddp.kernels.cuda use."""

    uint8, uint16, int32, float32 = np.uint8, np.uint16, np.int32, np.float32
    __version__ = "0.0-fake"

    def __init__(self, devices=1, cpu=True, sms=132):
        """cpu: run the real kernels compiled for the CPU (when a compiler exists), else the
        references; sms: the multiprocessor count the fake GPU reports."""
        self.cpu = cpu_kernels() if cpu else None
        self.heap = Heap(cpu=self.cpu)
        self.launches, self.uploads, self.memsets = [], [], []
        self.compiles = self.get_function_calls = 0
        self.kernel_names = None   # build only these instantiations (tests of planted bugs)
        self.cpu_override = None   # (Module, namespace): run that build's kernels instead
        FAKE_STATE["current"] = FakeStream(null=True)
        FAKE_STATE["sms"] = sms
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: devices,
            memsetAsync=lambda ptr, value, size, stream: self._memset(ptr, value, size, stream),
            getDeviceProperties=lambda dev: {"name": b"Fake GPU"},
            runtimeGetVersion=lambda: 12090,
            eventQuery=lambda ptr: FakeEvent.registry[ptr].status,
            CUDARuntimeError=FakeCUDARuntimeError)
        self.cuda = types.SimpleNamespace(
            is_available=lambda: devices > 0, runtime=runtime, Device=FakeDeviceCtx,
            Stream=FakeStream, Event=FakeEvent,
            get_current_stream=lambda device_id=-1: FAKE_STATE["current"],
            function=types.SimpleNamespace(CNumpyArray=FakeCNumpyArray),
            driver=types.SimpleNamespace(
                occupancyMaxActiveBlocksPerMultiprocessor=lambda func, block, smem: 4),
            get_elapsed_time=lambda start, end: 1.0)
        rng = np.random.default_rng(0)
        self.random = types.SimpleNamespace(
            standard_normal=lambda n, dtype=np.float64: self.asarray(
                rng.standard_normal(n).astype(dtype)))
        self.get_default_memory_pool = lambda: types.SimpleNamespace(
            free_all_blocks=lambda: None)
        self.RawModule = lambda code, options, name_expressions: FakeRawModule(
            self, code, options, name_expressions)

    def _memset(self, ptr, value, size, stream):
        self.memsets.append((ptr, size, stream))
        self.heap.view(ptr, size, np.uint8)[...] = value

    def empty(self, n, dtype, misalign=0, device_id=0):
        shape = n if isinstance(n, tuple) else (n,)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        a = Allocation(self.heap, nbytes, misalign)
        return FakeArray(self, a.ptr, shape, dtype, device_id, owner=a)

    zeros = empty   # the heap starts zeroed and is never reused

    def multiply(self, a, b, out):
        out.host()[...] = a.host() * b

    def asnumpy(self, a):
        return a.get()

    def asarray(self, host, misalign=0):
        a = self.empty(host.shape, host.dtype, misalign)
        a.host()[...] = host
        return a
