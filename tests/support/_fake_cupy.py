"""A fake CuPy for machines without a GPU: arrays live in one byte heap at fake device addresses,
and every kernel launch runs the REAL kernels/bucket.cu, compiled for the CPU (tests/support/cuda_cpu:
PTX mapped to software of the same semantics, warps as fibers, memcheck/racecheck-like checks),
from the raw arguments the launch path packs, checked like cuLaunchKernel. So the Python launch path
(tables, cache, chunking, argument packing, streams) drives the CUDA code end to end. Where no C++
compiler is available (`CPU_KERNELS_MISSING` says why) launches fall back to executing the NumPy
references on each work item the way bucket.cu reads its tables."""

import os
import re
import struct
import types
import weakref

import numpy as np

from nccl_ddp import kernels as K
from nccl_ddp.kernels import cuda as ck

BASE = 0x7F00_0000_0000  # device addresses when the kernels run as references
C_DTYPE = {"float": np.dtype(np.float32), "double": np.dtype(np.float64), "f16_t": np.dtype(np.float16)}


def _c_dtype(name):
    if name == "bf16_t":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return C_DTYPE[name]


def cpu_kernels():
    """The CPU build of the real kernels/*.cu (ck.module_source(), cached), or None (see
    CPU_KERNELS_MISSING)."""
    global CPU_KERNELS_MISSING
    if CPU_KERNELS_MISSING is not None:
        return None
    try:
        from cuda_cpu import runtime

        if runtime.compiler() is None:
            CPU_KERNELS_MISSING = "no C++ compiler (g++ or clang++) to build kernels/*.cu"
            return None
        return runtime.load(
            ck.module_source(),
            ck.name_expressions(),
            runtime.effective_ftz(cupy_nvrtc_options(ck.COMPILE_OPTIONS)),
        )
    except Exception as e:  # a build failure is a test failure: report it, do not fall back
        raise RuntimeError(f"building kernels/*.cu for the CPU failed: {e}") from e


CPU_KERNELS_MISSING = None


def cupy_nvrtc_options(options, arch="sm_90", nvrtc=(12, 9), use_pch=None):
    """The option list CuPy 14.2 hands NVRTC for RawModule(options=options): `-ftz=true` after
    ours (cupy/cuda/compiler.py _compile_with_cache_cuda), then the arch, then
    --device-as-default-execution-space, and --pch only when CUPY_NVRTC_USE_PCH=1 (read once at
    CuPy's import; opt-in) and NVRTC >= 12.8. `use_pch` None: read the environment as CuPy does."""
    if use_pch is None:
        try:
            use_pch = int(os.environ.get("CUPY_NVRTC_USE_PCH", "0")) == 1
        except ValueError:
            use_pch = False
    opts = tuple(options) + ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    if use_pch and nvrtc >= (12, 8):
        opts += ("--pch",)
    return opts


def nvrtc_log(options, cu_name="kern.cu"):
    """The program log NVRTC 12.9 writes for a warning-free source: empty, except the line --pch
    adds (seen with cupy_backends' nvrtc.getProgramLog)."""
    if "--pch" in options:
        return f'"{cu_name}": creating precompiled header file "{cu_name[:-3]}.pch"\n'
    return ""


class Heap:
    def __init__(self, nbytes=256 << 20, cpu=None):
        self.cpu = cpu  # the CPU kernel module, or None
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
        return self.mem[off : off + n * dtype.itemsize].view(dtype)


class Allocation:
    """One device allocation: live (for the kernels' memory checks) while any array uses it.
    Under the async pool (`cp.async_pool`) it is freed like CuPy 14.2's MemoryAsync
    (cupy/cuda/memory.pyx): cudaFreeAsync on the stream it was allocated on, held by a WEAK
    reference, or on the stream current at the free once that stream object is gone."""

    def __init__(self, heap, nbytes, misalign=0, cp=None):
        self.ptr = heap.alloc(nbytes, misalign)
        if heap.dev is not None and nbytes:
            heap.dev.register(self.ptr, nbytes)
            weakref.finalize(self, heap.dev.unregister, self.ptr)
        if cp is not None and cp.async_pool:
            weakref.finalize(self, cp.free_async, self.ptr, weakref.ref(FAKE_STATE["current"]))


class FakeArray:
    def __init__(self, cp, addr, shape, dtype, device_id=0, contiguous=True, owner=None):
        self.cp, self.dtype, self.shape = cp, np.dtype(dtype), tuple(shape)
        self.owner = owner  # the Allocation (kept alive by every view of it)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.strides = tuple(
            int(np.prod(self.shape[i + 1 :])) * self.dtype.itemsize for i in range(len(self.shape))
        )
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)
        self.data = FakeMemPtr(cp, addr)
        self.device = types.SimpleNamespace(id=device_id)

    def host(self):
        """A writable NumPy view of the array's bytes in the heap."""
        return self.cp.heap.view(self.data.ptr, self.size, self.dtype).reshape(self.shape)

    def set(self, arr, stream=None):  # CuPy keeps no reference to `stream`: only its pointer
        self.cp.uploads.append(None if stream is None else stream.ptr)
        self.host()[...] = arr

    # the little array arithmetic the benchmark script uses (1-D, computed on the host)
    def __getitem__(self, key):
        start, stop, step = key.indices(self.size)
        assert step == 1 and len(self.shape) == 1
        return FakeArray(
            self.cp,
            self.data.ptr + start * self.dtype.itemsize,
            (max(0, stop - start),),
            self.dtype,
            self.device.id,
            owner=self.owner,
        )

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
        return FakeArray(
            self.cp, self.data.ptr, (self.nbytes // dtype.itemsize,), dtype, self.device.id, owner=self.owner
        )

    def get(self):
        return self.host().copy()

    def copy(self):
        return self.cp.asarray(self.host().copy())


class FakeMemPtr:
    def __init__(self, cp, ptr):
        self.cp, self.ptr = cp, ptr

    def copy_from_device_async(self, src, nbytes, stream=None):
        self.cp.heap.view(self.ptr, nbytes, np.uint8)[...] = self.cp.heap.view(src.ptr, nbytes, np.uint8)


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
        FAKE_STATE["synced"][self.ptr] = FAKE_STATE["seq"]

    @classmethod
    def from_external(cls, obj):
        version, ptr = obj.__cuda_stream__()
        assert version == 0
        s = cls(ptr=ptr)
        s.external = obj
        return s


FAKE_STATE = {"current": FakeStream(null=True), "device": 0, "seq": 0, "synced": {}}


def _tick():
    """The fake GPU's clock: launches and event records in the order they were queued."""
    FAKE_STATE["seq"] += 1
    return FAKE_STATE["seq"]


class FakeEvent:
    """cupy.cuda.Event; `status` is what cudaEventQuery returns (0 done, 600 not ready, else a
    CUDA error)."""

    _next = 0xE000
    registry: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # ptr -> event

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded_on, self.recorded_at = None, 0
        self.status = 600
        FakeEvent._next += 16
        self.ptr = FakeEvent._next
        FakeEvent.registry[self.ptr] = self

    @property
    def done(self):  # CuPy 14: eventQuery(...) == 0, errors read as "not done"
        return self.status == 0

    @done.setter
    def done(self, value):
        self.status = 0 if value else 600

    def record(self, stream=None):  # CuPy: None records on the current stream
        self.recorded_on, self.recorded_at = stream, _tick()
        self.on_ptr = (stream or FAKE_STATE["current"]).ptr
        self.status = 600

    def synchronize(self):
        self.status = 0


class FakeCUDARuntimeError(RuntimeError):
    NAMES = {
        700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
        716: "cudaErrorMisalignedAddress: misaligned address",
    }

    def __init__(self, status):
        self.status = status
        super().__init__(self.NAMES.get(status, f"cudaError {status}"))


class FakeDeviceCtx:
    def __init__(self, device_id=None):
        self.id = FAKE_STATE["device"] if device_id is None else device_id
        self.attributes = {"MultiProcessorCount": FAKE_STATE.get("sms", 132)}
        self._prev = []

    def synchronize(self):
        return None

    def use(self):
        FAKE_STATE["device"] = self.id

    def __enter__(self):
        self._prev.append(FAKE_STATE["device"])
        FAKE_STATE["device"] = self.id
        return self

    def __exit__(self, *exc):
        FAKE_STATE["device"] = self._prev.pop()


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
        if -(2**63) <= a < 2**63:
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
        seq = _tick()
        for a in args:  # what this launch reads, for the async pool's free check
            if isinstance(a, FakeArray):
                self.cp.reads.setdefault(a.owner.ptr if a.owner else a.data.ptr, []).append(
                    (on, seq, self.name)
                )
        if self.cpu is not None:
            self.cpu.launch(
                self.cp.heap.dev, self.cpu_name, int(grid[0]), int(block[0]), [cupy_arg(a) for a in args]
            )
            return
        assert block == (ck.THREADS,) and grid[0] >= 1
        m = re.fullmatch(r"nd_(sgd|adamw)<(\w+), (\w+)>", self.name)
        if m:
            self._optim_ref(m.group(1), _c_dtype(m.group(2)), _c_dtype(m.group(3)), args)
            return
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
            assert isinstance(tab, FakeCNumpyArray)  # a pointer to the bytes, as in CuPy
            tab = tab.val
            assert isinstance(tab, np.ndarray) and tab.dtype == ck.SMALL_DTYPE and tab.size == 1
            raw = np.frombuffer(tab.tobytes(), ck.SMALL_DTYPE)[0]  # only the bytes travel
            k, first = int(raw["nseg"]), raw["first_item"]
            nitems = int(first[k])
            segs = [(int(raw["ptr"][t]), int(raw["off"][t]), int(raw["n"][t])) for t in range(k)]

            def find(item):  # bucket.cu SmallTable::find: the last slot whose first <= item
                t = max(s for s in range(ck.SMALL_MAX) if item >= first[s])
                return segs[t], item - int(first[t])
        else:
            items_arr, nitems, rest = args[0], args[1], args[2:]
            assert isinstance(items_arr, FakeArray) and isinstance(nitems, np.int32)
            items = self.cp.heap.view(items_arr.data.ptr, int(nitems), ck.SEG_DTYPE)

            def find(item):  # bucket.cu TableRef::find: one pre-chunked item, j = 0
                s = items[item]
                return (int(s["ptr"]), int(s["off"]), int(s["n"])), 0

        bucket, chunk, scale = rest[:3]
        assert isinstance(chunk, np.int32) and isinstance(scale, np.float64)
        assert grid[0] * ck.WARPS_PER_BLOCK >= int(nitems)
        flag = None
        assert len(rest) == 4  # pack: a flag exactly when checked; unpack: a flag or None
        assert op == "unpack" or (rest[3] is not None) == (variant == "true")
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
                K.unpack_ref(
                    [dst], src, [0], scale=float(scale), accumulate=variant == "true", nonfinite_flag=flag
                )


def _optim_arrays(fn, args, dtypes):
    """The arrays of an nd_sgd/nd_adamw launch as heap views (None for a NULL pointer)."""
    n = int(args[len(dtypes)])
    return [None if a is None else fn.cp.heap.view(a.data.ptr, n, dt) for a, dt in zip(args, dtypes)]


def _fake_optim_ref(fn, op, tg, tp, args):
    """Without a C++ compiler: an nd_sgd/nd_adamw launch executed by its reference."""
    from nccl_ddp.kernels import optim_spec as S

    f32 = np.dtype(np.float32)
    if op == "sgd":
        g, m, buf, out = _optim_arrays(fn, args, (tg, f32, f32, tp))
        sc = S.SgdScalars(*args[5:10], int(args[10]))
        S.sgd_ref(m, g, buf, out, sc)
    else:
        g, m, a, v, vmax, out = _optim_arrays(fn, args, (tg, f32, f32, f32, f32, tp))
        sc = S.AdamWScalars(*args[7:15], int(args[15]))
        S.adamw_ref(m, g, a, v, vmax, out, sc)


FakeFunction._optim_ref = lambda self, op, tg, tp, args: _fake_optim_ref(self, op, tg, tp, args)


class FakeCNumpyArray:
    """cupy.cuda.function.CNumpyArray: passes a NumPy array's bytes by value."""

    def __init__(self, v):
        self.val = v
        self.ptr = v.__array_interface__["data"][0]


class FakeRawModule:
    """cupy.RawModule: with a CPU build, compiles `code` (with the -ftz CuPy's option list
    implies) for the CPU once per instance. Modules are memoized like CuPy 14.2's
    `_get_raw_module` (cupy/_core/raw.pyx, `@memoize(for_each_device=True)`): per device on
    every argument, `log_stream` included, so `compile(log_stream=x)` and `get_function` (which
    reads `self.module`, log_stream=None) load the module twice; `cp.module_loads` counts loads."""

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

            names = self.cp.kernel_names or self.names  # a subset: quicker mutant builds
            self.module = runtime.load(
                self.code, names, runtime.effective_ftz(cupy_nvrtc_options(self.options))
            )

    def _module(self, log_stream=None):
        key = (FAKE_STATE["device"], self.code, self.options, self.names, log_stream)
        if key not in self.cp.modules:
            if log_stream is not None:  # only a compile writes the log; a disk-cache hit none
                log_stream.write(nvrtc_log(cupy_nvrtc_options(self.options)))
            self._build()
            self.cp.module_loads += 1
            self.cp.modules[key] = self
        return self.cp.modules[key]

    def compile(self, log_stream=None):
        self.cp.compiles += 1
        self._module(log_stream)

    def get_function(self, name):
        assert name in self.names, name
        self.cp.get_function_calls += 1
        self._module()
        return FakeFunction(self.cp, name, self.module, self.prefix)


class FakeCupy:
    """The slice of the CuPy API that nccl_ddp.device and nccl_ddp.kernels.cuda use."""

    uint8, uint16, int32, float32 = np.uint8, np.uint16, np.int32, np.float32
    __version__ = "0.0-fake"

    def __init__(self, devices=1, cpu=True, sms=132, async_pool=False):
        """cpu: run the real kernels compiled for the CPU (when a compiler exists), else the
        references; sms: the multiprocessor count the fake GPU reports; async_pool: allocate
        like cupy.cuda.MemoryAsyncPool and record in `hazards` every free that may overtake a
        launch still reading the memory (queued on another stream, not known to have run)."""
        self.cpu = cpu_kernels() if cpu else None
        self.heap = Heap(cpu=self.cpu)
        self.launches, self.uploads, self.memsets = [], [], []
        self.async_pool, self.reads, self.frees, self.hazards = async_pool, {}, [], []
        self.compiles = self.get_function_calls = self.module_loads = 0
        self.modules = {}  # CuPy's memo of _get_raw_module
        self.kernel_names = None  # build only these instantiations (tests of planted bugs)
        self.cpu_override = None  # (Module, namespace): run that build's kernels instead
        FAKE_STATE["current"] = FakeStream(null=True)
        FAKE_STATE["sms"], FAKE_STATE["device"] = sms, 0
        FAKE_STATE["synced"] = {}
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: devices,
            memsetAsync=lambda ptr, value, size, stream: self._memset(ptr, value, size, stream),
            getDeviceProperties=lambda dev: {"name": b"Fake GPU"},
            runtimeGetVersion=lambda: 12090,
            eventQuery=lambda ptr: FakeEvent.registry[ptr].status,
            CUDARuntimeError=FakeCUDARuntimeError,
        )
        self.cuda = types.SimpleNamespace(
            is_available=lambda: devices > 0,
            runtime=runtime,
            Device=FakeDeviceCtx,
            Stream=FakeStream,
            Event=FakeEvent,
            get_current_stream=lambda device_id=-1: FAKE_STATE["current"],
            function=types.SimpleNamespace(CNumpyArray=FakeCNumpyArray),
            driver=types.SimpleNamespace(
                occupancyMaxActiveBlocksPerMultiprocessor=lambda func, block, smem: 4
            ),
            get_elapsed_time=lambda start, end: 1.0,
        )
        rng = np.random.default_rng(0)
        self.random = types.SimpleNamespace(
            standard_normal=lambda n, dtype=np.float64: self.asarray(rng.standard_normal(n).astype(dtype))
        )
        self.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
        self.RawModule = lambda code, options, name_expressions: FakeRawModule(
            self, code, options, name_expressions
        )

    def free_async(self, ptr, stream_ref):
        """MemoryAsync.__dealloc__: cudaFreeAsync on the allocation stream if its object is alive,
        else on the current stream. A launch reading the memory on another stream that no
        completed event or synchronize has passed may run after the memory is reused."""
        stream = stream_ref() or FAKE_STATE["current"]
        self.frees.append((ptr, stream.ptr))
        for on, seq, name in self.reads.pop(ptr, []):
            if on != stream.ptr and not self.passed(on, seq):
                self.hazards.append(
                    f"{ptr:#x} freed on stream {stream.ptr:#x} while {name} on "
                    f"stream {on:#x} may still read it"
                )

    def passed(self, stream_ptr, seq):
        """Whether stream `stream_ptr` is known to have run everything queued up to `seq`."""
        if FAKE_STATE["synced"].get(stream_ptr, 0) >= seq:
            return True
        return any(
            getattr(ev, "on_ptr", None) == stream_ptr and ev.recorded_at >= seq and ev.status == 0
            for ev in list(FakeEvent.registry.values())
        )

    def _memset(self, ptr, value, size, stream):
        self.memsets.append((ptr, size, stream))
        self.heap.view(ptr, size, np.uint8)[...] = value

    def empty(self, n, dtype, misalign=0, device_id=0):
        shape = n if isinstance(n, tuple) else (n,)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        a = Allocation(self.heap, nbytes, misalign, cp=self)
        return FakeArray(self, a.ptr, shape, dtype, device_id, owner=a)

    zeros = empty  # the heap starts zeroed and is never reused

    def abs(self, a):
        return self.asarray(np.abs(a.host()))

    def multiply(self, a, b, out):
        out.host()[...] = a.host() * b

    def asnumpy(self, a):
        return a.get()

    def asarray(self, host, misalign=0):
        a = self.empty(host.shape, host.dtype, misalign)
        a.host()[...] = host
        return a
