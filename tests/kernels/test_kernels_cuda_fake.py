"""The CUDA path of nccl_ddp.kernels and the "cuda" device, on a fake CuPy (tests/support/_fake_cupy.py):
launch count, tables passed by value or uploaded and cached, argument types, streams, events."""

import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from _fake_cupy import FakeCupy, FakeStream
from paths import ROOT

from nccl_ddp import device as D
from nccl_ddp import kernels as K
from nccl_ddp.errors import CommTimeout, ConfigError, KernelError
from nccl_ddp.kernels import cuda as ck

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def cp(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
    return fake


@pytest.fixture
def cp_ref(monkeypatch):
    """The fake with the references for arithmetic (the benchmark tests check the script's
    logic; the CPU build of the kernels would only make them slower)."""
    fake = FakeCupy(cpu=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
    return fake


def _case(cp, rng, sizes, sdtype, misalign_every=3):
    """Host sources, their fake-device copies (some misaligned by 4 bytes), packed offsets."""
    hosts = [rng.standard_normal(int(n)).astype(sdtype) for n in sizes]
    devs = [cp.asarray(h, misalign=4 if i % misalign_every == 1 else 0) for i, h in enumerate(hosts)]
    offs = (np.cumsum(sizes) - sizes).tolist()
    return hosts, devs, offs, int(np.sum(sizes))


@pytest.mark.parametrize("count", [1, 5, 32, 33, 100, 10_000])
@pytest.mark.parametrize("bucket_dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_pack_then_unpack_one_launch_each_matches_reference(cp, count, bucket_dtype):
    rng = np.random.default_rng(count)
    sizes = rng.integers(0, 40 if count > 100 else 5000, count)
    sizes[0] = 0 if count > 1 else 7
    hosts, devs, offs, total = _case(cp, rng, sizes, np.float32)
    bdt = BF16 if bucket_dtype == "bfloat16" else np.dtype(np.float32)
    bucket = cp.asarray(np.full(total + 3, np.nan, bdt))
    flag = cp.asarray(np.zeros(1, np.int32))
    want = np.full(total + 3, np.nan, bdt)
    want_flag = np.zeros(1, np.int32)
    K.pack_ref(hosts, want, offs, scale=0.5, nonfinite_flag=want_flag)

    K.pack(devs, bucket, offs, scale=0.5, nonfinite_flag=flag)
    assert len(cp.launches) == 1
    small = (sizes > 0).sum() <= ck.SMALL_MAX
    assert cp.launches[0][0].startswith("nd_pack_small<" if small else "nd_pack<")
    assert len(cp.uploads) == (0 if small else 1)
    np.testing.assert_array_equal(bucket.host().astype(np.float64), want.astype(np.float64))
    assert flag.host()[0] == want_flag[0] == 0

    outs = [cp.asarray(np.full(h.shape, -7.0, np.float32), misalign=4 * (i % 2)) for i, h in enumerate(hosts)]
    K.unpack(outs, bucket, offs, scale=2.0, accumulate=True)
    assert len(cp.launches) == 2
    assert len(cp.uploads) == (0 if small else 2)  # outs have other pointers: own table
    ref_outs = [np.full(h.shape, -7.0, np.float32) for h in hosts]
    K.unpack_ref(ref_outs, want, offs, scale=2.0, accumulate=True)
    for o, r in zip(outs, ref_outs):
        np.testing.assert_array_equal(o.host(), r)
    assert cp.compiles == 1


def test_nonfinite_flag_through_the_fake_gpu(cp):
    x = np.ones(50, np.float32)
    x[17] = np.inf
    bucket = cp.asarray(np.zeros(64, np.float16))
    flag = cp.asarray(np.zeros(1, np.int32))
    K.pack([cp.asarray(np.ones(3, np.float32))], bucket, [0], nonfinite_flag=flag)
    assert flag.host()[0] == 0
    K.pack([cp.asarray(x)], bucket, [8], nonfinite_flag=flag)
    assert flag.host()[0] == 1
    K.zero_(flag)
    assert flag.host()[0] == 0 and cp.memsets[-1][1] == 4


def test_table_cache_reused_for_same_pointers_rebuilt_when_they_change(cp):
    kb = ck.backend()
    rng = np.random.default_rng(1)
    hosts, devs, offs, total = _case(cp, rng, np.full(64, 100), np.float32)
    bucket = cp.empty(total, np.float32)
    for _ in range(3):
        K.pack(devs, bucket, offs)
    assert kb.stats["table_builds"] == 1 and kb.stats["table_uploads"] == 1
    assert kb.stats["launches"] == 3
    assert kb._resident == {
        (0, "nd_pack<float, float, false>"): 4 * 132 * 8,
        (0, "nd_pack<float, float, true>"): 4 * 132 * 8,
    }
    # unpack has its own table (its kernel's occupancy may differ), cached the same way
    K.unpack(devs, bucket, offs)
    K.unpack(devs, bucket, offs)
    assert kb.stats["table_builds"] == 2
    devs[5] = cp.asarray(hosts[5])  # one pointer changes
    K.pack(devs, bucket, offs)
    assert kb.stats["table_builds"] == 3 and kb.stats["table_uploads"] == 3
    # another stream: a table is never shared across streams (pool reuse is stream-ordered)
    with FakeStream(non_blocking=True) as s:
        K.pack(devs, bucket, offs)
        assert cp.uploads[-1] == s.ptr and cp.launches[-1][2] == s.ptr
    assert kb.stats["table_builds"] == 4
    np.testing.assert_array_equal(bucket.host(), np.concatenate(hosts))


def test_table_cache_is_bounded(cp, monkeypatch):
    monkeypatch.setattr(ck, "TABLE_CACHE_SIZE", 4)
    bucket = cp.empty(40 * 8, np.float32)
    for _ in range(10):
        devs = [cp.asarray(np.ones(8, np.float32)) for _ in range(40)]
        K.pack(devs, bucket, [8 * i for i in range(40)])
    assert len(ck.backend()._tables) == 4 and ck.backend().stats["table_builds"] == 10


def test_empty_calls_launch_nothing(cp):
    bucket = cp.empty(8, np.float32)
    K.pack([cp.empty(0, np.float32)] * 3, bucket, [0, 0, 0])
    K.unpack([], bucket, [])
    K.scale_(cp.empty(0, np.float32), 2.0)
    assert cp.launches == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_scale_one_launch_on_the_current_stream(cp, dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = np.random.default_rng(2).standard_normal(100_003).astype(dt)
    d = cp.asarray(x, misalign=dt.itemsize)
    with FakeStream(non_blocking=True) as s:
        K.scale_(d, 0.25)
    assert [(n, st) for n, _, st in cp.launches] == [(f"nd_scale<{ck.C_TYPE[dtype]}>", s.ptr)]
    want = x.copy()
    K.scale_ref(want, 0.25)
    np.testing.assert_array_equal(d.host().astype(np.float64), want.astype(np.float64))


def test_cuda_errors(cp):
    bucket = cp.empty(16, np.float32)
    other = cp.empty(4, np.float32, device_id=1)
    with pytest.raises(KernelError, match="array 1 is on device 1 but the bucket is on device 0"):
        K.pack([cp.empty(4, np.float32), other], bucket, [0, 8])
    nc = cp.empty(4, np.float32)
    nc.flags.c_contiguous = False
    with pytest.raises(KernelError, match="array 0 .* is not contiguous"):
        K.unpack([nc], bucket, [0])
    with pytest.raises(KernelError, match="array 0 is a numpy.ndarray but the bucket is a _fake_cupy array"):
        K.pack([np.ones(4, np.float32)], bucket, [0])
    with pytest.raises(KernelError, match="nonfinite_flag is a numpy array but the bucket"):
        K.pack([cp.empty(4, np.float32)], bucket, [0], nonfinite_flag=np.zeros(1, np.int32))
    with pytest.raises(KernelError, match="float64->bfloat16 is not supported"):
        K.pack([cp.empty(4, np.float64)], cp.empty(4, BF16), [0])
    assert cp.launches == []


# ---------------------------------------------------------------------------------------------
# the "cuda" device


def test_cuda_stream_submit_makes_it_current_and_restores(cp):
    dev = D.get_device("cuda", local_rank=3)  # one visible GPU: local rank -> GPU 0
    assert isinstance(dev, D.CudaDevice) and dev.kind == "cuda" and dev.device_id == 0
    s = dev.new_stream()
    assert s.stream.non_blocking
    before = cp.cuda.get_current_stream()
    seen = []
    s.submit(lambda a, b=0: seen.append((cp.cuda.get_current_stream(), a, b)), 1, b=2)
    assert seen == [(s.stream, 1, 2)] and cp.cuda.get_current_stream() is before
    assert dev.current_stream().stream is before


def test_cuda_events_record_wait_and_bounded_synchronize(cp):
    dev = D.CudaDevice(0)
    a, b = dev.new_stream(), dev.new_stream()
    ev = a.record()
    assert ev.event.recorded_on is a.stream and not ev.query()
    b.wait(ev)
    assert b.stream.waited == [ev.event]
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="CUDA event not reached within 0.1s"):
        ev.synchronize(timeout=0.1)
    assert time.monotonic() - t0 < 30  # not the 300 s default
    ev.event.done = True
    ev.synchronize(timeout=0.1)
    assert ev.query()


def test_get_device_kinds(cp, monkeypatch):
    assert isinstance(D.get_device(), D.CudaDevice)
    assert isinstance(D.get_device("host"), D.HostDevice)
    with pytest.raises(ConfigError, match="unknown device kind"):
        D.get_device("tpu")
    with pytest.raises(ConfigError, match="CUDA device 5 does not exist"):
        D.CudaDevice(5)
    monkeypatch.setattr(cp.cuda, "is_available", lambda: False)
    assert isinstance(D.get_device(), D.HostDevice)
    with pytest.raises(ConfigError, match="CuPy is missing or sees no GPU"):
        D.get_device("cuda")


def test_nccl_world_group_runs_on_the_gpu_ddp_uses(cp, monkeypatch):
    """Each process sees one GPU (CUDA_VISIBLE_DEVICES per rank): LOCAL_RANK 1 is GPU 0 for the
    communicator as for DDP's device (the group used to be built for the missing GPU 1)."""
    from types import SimpleNamespace

    from nccl_ddp.comm import api
    from nccl_ddp.comm.nccl.backend import NcclProcessGroup

    seen = {}
    monkeypatch.setattr(NcclProcessGroup, "create", classmethod(lambda cls, *a, **kw: seen.update(kw)))
    api._create_group("nccl", None, SimpleNamespace(rank=1, world_size=2, local_rank=1), 5.0)
    assert seen["device_id"] == 0 == D.get_device("cuda", 1).device_id


# ---------------------------------------------------------------------------------------------
# scripts/bench_kernels.py, end to end on the fake (its logic; the numbers mean nothing here)


def _bench_module(monkeypatch):
    import importlib.util

    path = ROOT / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(D, "cuda_available", lambda: True)
    return bench


@pytest.mark.slow
def test_bench_kernels_runs_and_writes_csv(cp_ref, monkeypatch, tmp_path, capsys):
    import csv

    cp = cp_ref
    bench = _bench_module(monkeypatch)
    out = tmp_path / "k.csv"
    rc = bench.main(
        [
            "--sizes",
            "1",
            "--counts",
            "1,40",
            "--chunk-bytes",
            "4096,0",
            "--reps",
            "2",
            "--batch",
            "2",
            "--naive-reps",
            "1",
            "--rotate-mib",
            "1",
            "--csv",
            str(out),
            "--png",
            str(tmp_path / "k.png"),
            "--ops",
            "pack,unpack",
        ]
    )
    assert rc == 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "k.png").stat().st_size > 1000
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * 2 * 2 * 2  # chunks x ops x pairs x counts
    assert {r["fixed_B"] for r in rows} == {"4096", "auto"} and ck.CHUNK_BYTES is None
    assert {r["chunk"] for r in rows if r["fixed_B"] == "4096"} == {"1024"}
    for r in rows:
        assert float(r["ratio"]) > 0 and float(r["kernel_GBps"]) > 0
    printed = capsys.readouterr().out
    assert "Fake GPU" in printed and "kernel_GBps" in printed
    names = {n.split("<")[0] for n, _, _ in cp.launches}
    assert names == {"nd_pack_small", "nd_pack", "nd_unpack_small", "nd_unpack"}


@pytest.mark.slow
def test_bench_kernels_fused_optimizer_rows(cp_ref, monkeypatch, tmp_path):
    """sgd/adamw: one row per (op, pair, size) whatever the chunk sweep and tensor counts, each
    pair's grad/parameter dtypes launched."""
    import csv

    bench = _bench_module(monkeypatch)
    out = tmp_path / "k.csv"
    rc = bench.main(
        [
            "--sizes",
            "1",
            "--counts",
            "1,40",
            "--chunk-bytes",
            "4096,0",
            "--reps",
            "2",
            "--batch",
            "2",
            "--rotate-mib",
            "1",
            "--csv",
            str(out),
            "--png",
            str(tmp_path / "k.png"),
            "--ops",
            "sgd,adamw",
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["op"], r["pair"]) for r in rows] == [
        ("sgd", "f32"),
        ("sgd", "f32-bf16"),
        ("adamw", "f32"),
        ("adamw", "f32-bf16"),
    ]
    for r in rows:
        assert float(r["ratio"]) > 0 and float(r["kernel_GBps"]) > 0 and float(r["call_us"]) > 0
    assert {n for n, _, _ in cp_ref.launches} == {
        "nd_sgd<float, float>",
        "nd_sgd<bf16_t, bf16_t>",
        "nd_adamw<float, float>",
        "nd_adamw<bf16_t, bf16_t>",
    }


def test_small_table_can_be_switched_off(cp, monkeypatch):
    monkeypatch.setenv("NCCL_DDP_SMALL_TABLE_MAX", "0")
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    x = np.arange(10, dtype=np.float32)
    bucket = cp.empty(16, np.float32)
    K.pack([cp.asarray(x)], bucket, [4], scale=2.0)
    assert cp.launches[-1][0] == "nd_pack<float, float, false>" and len(cp.uploads) == 1
    np.testing.assert_array_equal(bucket.host()[4:14], 2 * x)


def test_bench_kernels_keeps_going_after_a_failed_measurement(cp_ref, monkeypatch, tmp_path, capsys):
    import csv

    bench = _bench_module(monkeypatch)
    real = bench.Bench.measure

    def measure(self, op, pair_key, mib, count):
        if pair_key == "f32-bf16":
            raise TypeError("no bfloat16 here")
        return real(self, op, pair_key, mib, count)

    monkeypatch.setattr(bench.Bench, "measure", measure)
    out = tmp_path / "k.csv"
    rc = bench.main(
        [
            "--sizes",
            "1",
            "--counts",
            "3",
            "--reps",
            "1",
            "--batch",
            "1",
            "--naive-reps",
            "1",
            "--rotate-mib",
            "1",
            "--csv",
            str(out),
            "--png",
            "",
            "--ops",
            "pack,unpack",
        ]
    )
    assert rc == 1
    assert [r["pair"] for r in csv.DictReader(out.open())] == ["f32", "f32"]
    assert "pack f32-bf16 1 MiB x3: FAILED TypeError: no bfloat16 here" in capsys.readouterr().err


def test_a_cuda_error_is_reported_at_once_not_as_a_timeout(cp):
    """cudaEventQuery returns the error (700) instead of 0/600: KernelError naming it, at once
    (CuPy's Event.done reads it as "not done", so this used to poll until the timeout)."""
    ev = D.CudaDevice(0).new_stream().record()
    ev.event.status = 700
    t0 = time.monotonic()
    with pytest.raises(KernelError, match="cudaErrorIllegalAddress"):
        ev.synchronize(timeout=30)
    assert time.monotonic() - t0 < 5
    ev.event.status = 600
    assert not ev.query()


def test_one_raw_kernel_per_device_and_name(cp):
    """get_function builds a new RawKernel (cuModuleGetFunction) per call in CuPy 14: cached."""
    bucket = cp.empty(64, np.float32)
    for _ in range(3):
        K.pack([cp.asarray(np.ones(8, np.float32))], bucket, [0])
        K.scale_(bucket, 0.5)
    assert len(cp.launches) == 6 and cp.compiles == 1
    # pack's occupancy query looks up both variants once; nothing more after the first round
    assert sorted(ck.backend()._functions) == [
        (0, "nd_pack_small<float, float, false>"),
        (0, "nd_pack_small<float, float, true>"),
        (0, "nd_scale<float>"),
    ]
    assert cp.get_function_calls == 3


def test_inputs_the_gpu_cannot_take_are_refused(cp):
    """Misaligned pointers, unpack destinations sharing memory and a pack source overlapping the
    bucket ranges written: each a KernelError before any launch (the CPU build of the kernels
    reports a misaligned access, a race and an __ldg hazard for them)."""
    bucket = cp.empty(64, np.float32)
    x = cp.asarray(np.ones(9, np.float32), misalign=2)
    with pytest.raises(
        KernelError, match="array 1 starts at 0x[0-9a-f]+, not a multiple of its 4-byte element size"
    ):
        K.pack([cp.asarray(np.ones(3, np.float32)), x], bucket, [0, 8])
    with pytest.raises(KernelError, match="the bucket starts at .* not a multiple"):
        K.unpack([cp.empty(4, np.float32)], cp.empty(8, np.float32, misalign=1), [0])
    big = cp.empty(100, np.float32)
    with pytest.raises(KernelError, match="arrays 0 and 2 share memory"):
        K.unpack([big[40:100], cp.empty(5, np.float32), big[0:60]], bucket, [0, 0, 0])
    with pytest.raises(KernelError, match="array 0 overlaps the bucket range being packed"):
        K.pack([bucket[0:10]], bucket, [5])
    with pytest.raises(KernelError, match="array 1 overlaps the bucket range"):
        K.pack([cp.empty(4, np.float32), bucket[30:34]], bucket, [0, 28])
    assert cp.launches == []
    # fine: adjacent destinations, a source in the bucket outside the written ranges, empty
    K.unpack([big[0:50], big[50:100], big[0:0]], bucket, [0, 0, 0])
    K.pack([bucket[40:50], cp.empty(0, np.float32, misalign=1)], bucket, [0, 0])
    assert len(cp.launches) == 2


class _CudaView:
    """A framework array that says it lives on the GPU (its bytes are the wrapped CPU array's)."""

    def __init__(self, x, dtype):
        self.x, self.dtype = x, dtype
        self.device = SimpleNamespace(type="cuda")

    def detach(self):
        return self

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


def _cupy_from_dlpack(cp, seen):
    def from_dlpack(x, kind):
        """CuPy 14's from_dlpack of a bfloat16 GPU array: an ml_dtypes.bfloat16 array."""
        assert kind == 2
        seen.append(x)
        return cp.asarray(np.asarray(x.x).view(BF16) if x.x.dtype != BF16 else x.x)

    return from_dlpack


@pytest.fixture
def frameworks():
    """torch and JAX imported before the fake CuPy replaces `cupy` (torch imports cupyx)."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from nccl_ddp.adapters.jax import adapter as jax_adapter
    from nccl_ddp.adapters.torch import tensors as torch_adapter

    return torch, jax, torch_adapter, jax_adapter


def test_bfloat16_cuda_tensors_go_to_the_kernels(frameworks, cp, monkeypatch):
    """torch and JAX bfloat16 grads on the GPU reach the bf16 kernels (they used to be refused
    with ConfigTypeError)."""
    torch, jax, torch_adapter, jax_adapter = frameworks
    seen = []
    monkeypatch.setattr(torch_adapter, "native_from_dlpack", _cupy_from_dlpack(cp, seen))
    t = torch.randn(37).to(torch.bfloat16)
    native = torch_adapter.to_native(_CudaView(t.view(torch.int16).numpy(), torch.bfloat16))
    assert native.dtype == BF16 and len(seen) == 1
    bucket = cp.asarray(np.full(40, np.nan, BF16))
    K.pack([native], bucket, [1], scale=0.5)
    want = np.full(40, np.nan, BF16)
    K.pack_ref([t.view(torch.int16).numpy().view(BF16)], want, [1], scale=0.5)
    np.testing.assert_array_equal(bucket.host().view(np.uint16), want.view(np.uint16))

    monkeypatch.setattr(jax, "Array", _CudaView)
    monkeypatch.setattr(jax_adapter, "native_from_dlpack", _cupy_from_dlpack(cp, seen))
    x = np.arange(5, dtype=np.float32).astype(BF16)
    native = jax_adapter.to_native(_CudaView(x, BF16))
    assert native.dtype == BF16 and len(seen) == 2
    out = cp.asarray(np.zeros(5, np.float32))
    K.unpack([out], native, [0], scale=2.0)
    np.testing.assert_array_equal(out.host(), 2 * np.arange(5, dtype=np.float32))


def test_module_loaded_once_per_device(cp):
    """CuPy memoizes RawModule's module on every argument, log_stream included, and get_function
    reads it with log_stream=None: compiling with a log stream loaded bucket.cu twice."""
    bucket = cp.empty(64, np.float32)
    K.pack([cp.asarray(np.ones(8, np.float32))], bucket, [0])
    K.scale_(bucket, 0.5)
    assert cp.compiles == 1 and cp.module_loads == 1


def test_fake_nvrtc_options_follow_cupy_14_2(monkeypatch):
    """--pch is opt-in in CuPy 14.2 (CUPY_NVRTC_USE_PCH=1, NVRTC >= 12.8), and with it NVRTC
    writes a line to the program log."""
    from _fake_cupy import cupy_nvrtc_options, nvrtc_log

    monkeypatch.delenv("CUPY_NVRTC_USE_PCH", raising=False)
    base = cupy_nvrtc_options(("-std=c++17",))
    assert (
        base == ("-std=c++17", "-ftz=true", "-arch=sm_90", "--device-as-default-execution-space")
        and nvrtc_log(base) == ""
    )
    monkeypatch.setenv("CUPY_NVRTC_USE_PCH", "1")
    assert cupy_nvrtc_options(("-std=c++17",))[-1] == "--pch"
    assert "--pch" not in cupy_nvrtc_options(("-std=c++17",), nvrtc=(12, 6))
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"NVRTC not usable ({e})")
    for opts in (base, base + ("--pch",)):  # the real NVRTC's log for the same options
        prog = nvrtc.createProgram('extern "C" __global__ void k(float* x) { x[0] = 1.f; }', "k.cu", [], [])
        nvrtc.compileProgram(prog, list(opts))
        assert nvrtc.getProgramLog(prog).replace("\x00", "") == nvrtc_log(opts, "k.cu")


@pytest.mark.parametrize("evict", [False, True])
def test_device_table_outlives_its_launch_under_the_async_pool(monkeypatch, evict):
    """Defect 2 of issue 23: under MemoryAsyncPool a table buffer allocated under a short-lived
    Stream.from_external (the torch adapter's) is freed on whatever stream is current once that
    object is gone: leaving the cache (cleared or evicted) before the launch reading it had run,
    it could be reused under the launch. It is now held until an event after the launch is
    reached."""
    import gc

    from _fake_cupy import FakeEvent

    fake = FakeCupy(cpu=False, async_pool=True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    kb = ck.CudaKernels(fake)
    monkeypatch.setattr(ck, "_BACKEND", kb)
    monkeypatch.setattr(ck, "TABLE_CACHE_SIZE", 1)

    class TorchStream:
        def __cuda_stream__(self):
            return (0, 0xABC0)

    srcs = [fake.asarray(np.full(4, i, np.float32)) for i in range(ck.SMALL_MAX + 8)]
    bucket = fake.empty(4 * len(srcs), np.float32)
    with fake.cuda.Stream.from_external(TorchStream()):
        K.pack(srcs, bucket, [4 * i for i in range(len(srcs))])
    assert fake.uploads and fake.launches[-1][2] == 0xABC0
    table_ptr = next(iter(kb._tables.values()))[0].device_buf.data.ptr
    side = fake.cuda.Stream(non_blocking=True)

    def drop(k):
        with side:
            if evict:  # another table (other pointers, on the side stream) pushes it out
                K.pack(srcs[k:] + srcs[:k], bucket, [4 * i for i in range(len(srcs))])
            else:
                kb.clear_cache()
        gc.collect()

    drop(1)
    assert fake.hazards == []
    assert table_ptr not in [p for p, _ in fake.frees]  # still held: its launch may be queued
    for ev in list(FakeEvent.registry.values()):  # the GPU ran the launch stream's work
        if getattr(ev, "on_ptr", None) == 0xABC0:
            ev.done = True
    drop(2)
    assert table_ptr in [p for p, _ in fake.frees] and fake.hazards == []
