"""A fake CuPy for machines without a GPU: arrays live in one NumPy byte heap at fake device
addresses, and every kernel launch is executed from its RAW ARGUMENTS (the by-value SmallTable
bytes, or the segment table and item map read back from the heap), the way bucket.cu reads them,
with the NumPy references doing the arithmetic on each work item. So the Python launch path
(argument packing, tables, cache, streams) is tested end to end; the CUDA code itself is not."""
import re
import types

import numpy as np

from nccl_ddp.kernels import cuda as ck
from nccl_ddp import kernels as K

BASE = 0x7F00_0000_0000
C_DTYPE = {"float": np.dtype(np.float32), "double": np.dtype(np.float64),
           "f16_t": np.dtype(np.float16)}


def _c_dtype(name):
    if name == "bf16_t":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return C_DTYPE[name]


class Heap:
    def __init__(self, nbytes=256 << 20):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top = 0

    def alloc(self, nbytes, misalign=0):
        off = -(-self.top // 256) * 256 + misalign
        if off + nbytes > self.mem.size:
            raise MemoryError("fake heap full")
        self.top = off + nbytes
        return BASE + off

    def view(self, addr, n, dtype):
        dtype = np.dtype(dtype)
        off = addr - BASE
        assert 0 <= off and off + n * dtype.itemsize <= self.top, "access outside allocations"
        return self.mem[off:off + n * dtype.itemsize].view(dtype)


class FakeArray:
    def __init__(self, cp, addr, shape, dtype, device_id=0, contiguous=True):
        self.cp, self.dtype, self.shape = cp, np.dtype(dtype), tuple(shape)
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
                         (max(0, stop - start),), self.dtype, self.device.id)

    def __setitem__(self, key, value):
        self.host()[key] = value.host() if isinstance(value, FakeArray) else value

    def __mul__(self, other):
        return self.cp.asarray(self.host() * other)

    def astype(self, dtype):
        return self.cp.asarray(self.host().astype(dtype))

    def fill(self, value):
        self.host()[...] = value

    def view(self, dtype):
        dtype = np.dtype(dtype)
        return FakeArray(self.cp, self.data.ptr, (self.nbytes // dtype.itemsize,), dtype,
                         self.device.id)

    def get(self):
        return self.host().copy()


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
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded_on = None
        self.done = False

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        self.done = True


class FakeDeviceCtx:
    def __init__(self, device_id=None):
        self.id = 0 if device_id is None else device_id
        self.attributes = {"MultiProcessorCount": 132}

    def synchronize(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class FakeFunction:
    def __init__(self, cp, name):
        self.cp, self.name = cp, name
        self.kernel = types.SimpleNamespace(ptr=hash(name) & 0xFFFF_FFFF)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert block == (ck.THREADS,) and len(grid) == 1 and grid[0] >= 1
        on = (stream or FAKE_STATE["current"]).ptr
        self.cp.launches.append((self.name, grid[0], on))
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
    def __init__(self, cp, code, options, name_expressions):
        assert "nd_pack" in code and "-std=c++17" in options
        self.cp, self.names = cp, set(name_expressions)

    def compile(self, log_stream=None):
        self.cp.compiles += 1

    def get_function(self, name):
        assert name in self.names, name
        return FakeFunction(self.cp, name)


class FakeCupy:
    """The slice of the CuPy API that nccl_ddp.device and nccl_ddp.kernels.cuda use."""

    uint8, uint16, int32, float32 = np.uint8, np.uint16, np.int32, np.float32
    __version__ = "0.0-fake"

    def __init__(self, devices=1):
        self.heap = Heap()
        self.launches, self.uploads, self.memsets = [], [], []
        self.compiles = 0
        FAKE_STATE["current"] = FakeStream(null=True)
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: devices,
            memsetAsync=lambda ptr, value, size, stream: self._memset(ptr, value, size, stream),
            getDeviceProperties=lambda dev: {"name": b"Fake GPU"},
            runtimeGetVersion=lambda: 12090)
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
        return FakeArray(self, self.heap.alloc(nbytes, misalign), shape, dtype, device_id)

    zeros = empty   # the heap starts zeroed and is never reused

    def multiply(self, a, b, out):
        out.host()[...] = a.host() * b

    def asnumpy(self, a):
        return a.get()

    def asarray(self, host, misalign=0):
        a = self.empty(host.shape, host.dtype, misalign)
        a.host()[...] = host
        return a
