"""The CPU build of the CUDA kernels (tests/support/cuda_cpu) checks what it claims to: the software PTX
against NumPy, the translator's refusals, memcheck/racecheck/__ldg/vote/launch-argument errors,
and a self-check that plants known bugs in copies of bucket.cu and of the launch code
(nccl_ddp/kernels/cuda.py) and requires every one to be caught."""

import ctypes
import importlib.util
import sys
from pathlib import Path

import _fake_cupy
import numpy as np
import pytest
from _fake_cupy import FakeCupy
from cuda_cpu import runtime, translate

from nccl_ddp import kernels as K
from nccl_ddp.errors import KernelError
from nccl_ddp.kernels import cuda as ck

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
SOURCE = (ck.kernel_source_dir() / "bucket.cu").read_text()
CUDA_PY = (ck.__file__, Path(ck.__file__).read_text())


@pytest.fixture(scope="module")
def module():
    if _fake_cupy.cpu_kernels() is None:
        pytest.skip(_fake_cupy.CPU_KERNELS_MISSING)
    return _fake_cupy.cpu_kernels()


@pytest.fixture
def cp(module, monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
    return fake


# ---------------------------------------------------------------------------------------------
# software PTX against NumPy


def _ptx(module, op, a, b=None, out_dtype=np.float32):
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(a if b is None else b)
    out = np.empty(a.size, out_dtype)
    module.lib.cc_ptx(
        op,
        a.ctypes.data_as(ctypes.c_void_p),
        b.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_size_t(a.size),
    )
    return out


def _edge_floats(rng, n):
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0,
            0x80000000,
            1,
            0x80000001,
            0x007FFFFF,
            0x00800000,
            0x7F7FFFFF,
            0x7F800000,
            0xFF800000,
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x33000000,
            0x33000001,
            0x387FE000,
            0x387FF000,
            0x38800000,
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x7F7F8000,
            0x7F7F7FFF,
        ],
        np.uint32,
    )
    small = (rng.integers(0, 2**23, n // 2) | (rng.integers(0, 2, n // 2) << 31)).astype(np.uint32)
    return np.concatenate([special, bits, small]).view(np.float32)


def test_software_ptx_matches_numpy(module):
    rng = np.random.default_rng(0)
    x = _edge_floats(rng, 200_000)
    y = _edge_floats(rng, 200_000)[: x.size]
    y = np.resize(y, x.size)
    fin = ~np.isnan(x)
    with np.errstate(all="ignore"):
        for op, ref in ((0, x * y), (1, x + y)):
            got = _ptx(module, op, x, y)
            nan = np.isnan(ref)
            assert (np.isnan(got) == nan).all()
            assert (got[nan].view(np.uint32) == 0x7FFFFFFF).all()  # the GPU's canonical NaN
            np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
        bf = _ptx(module, 2, x, out_dtype=np.uint16)
        np.testing.assert_array_equal(bf[fin], x[fin].astype(BF16).view(np.uint16))
        assert (bf[~fin] == 0x7FFF).all()
        h = _ptx(module, 3, x, out_dtype=np.uint16)
        np.testing.assert_array_equal(h[fin], x[fin].astype(np.float16).view(np.uint16))
        every_half = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
        f = _ptx(module, 4, every_half)
        ref = every_half.view(np.float16).astype(np.float32)
        ok = ~np.isnan(ref)
        np.testing.assert_array_equal(f[ok].view(np.uint32), ref[ok].view(np.uint32))
        d = rng.standard_normal(100_000) * 2.0 ** rng.integers(-160, 140, 100_000)
        np.testing.assert_array_equal(
            _ptx(module, 5, d).view(np.uint32), d.astype(np.float32).view(np.uint32)
        )
        ftz = _ptx(module, 6, np.float32([1e-39, 3.0, 1e-20]), np.float32([1.0, 1e-39, 1e-20]))
        assert (ftz == 0).all()  # the -ftz=true model flushes inputs and results


# ---------------------------------------------------------------------------------------------
# the translator refuses what it does not model


@pytest.mark.parametrize(
    "snippet, message",
    [
        ("#include <cuda_fp16.h>\n", "preprocessor directive '#include <cuda_fp16.h>'"),
        ("#define X 1\n", "preprocessor directive"),
        (
            (
                '__device__ float f(float a) { float r; asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); '
                "return r; }\n"
            ),
            "inline PTX 'rcp.rn.f32 %0, %1;' is not modelled",
        ),
        (
            (
                '__device__ float f(float a) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=r"(r) : '
                '"f"(a), "f"(a)); return r; }\n'
            ),
            'needs one "=f" output',
        ),
        (
            "__device__ int f(int a) { return __shfl_sync(0xffffffffu, a, 0); }\n",
            "__shfl_sync is not modelled",
        ),
        ("__device__ void f() { __syncthreads(); }\n", "__syncthreads is not modelled"),
        ("__device__ int f(int* p) { return atomicAdd(p, 1); }\n", "atomicAdd is not modelled"),
        ('__device__ void f() { asm volatile("membar.gl;"); }\n', "not model"),
    ],
)
def test_translator_refuses_what_it_does_not_model(snippet, message):
    with pytest.raises(
        translate.TranslateError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
    ):
        translate.translate(SOURCE + snippet, "bucket.cu")


def test_translation_maps_every_ptx_statement_and_keeps_lines():
    code, bounds = translate.translate(SOURCE)
    assert "asm" not in code and code.count("\n") == SOURCE.count("\n")
    assert code.count("::cuda_cpu::ptx_") == SOURCE.count("asm(") == 6
    assert bounds == {
        n: "kThreads" for n in ("nd_pack", "nd_pack_small", "nd_unpack", "nd_unpack_small", "nd_scale")
    }


TINY = """
__global__ void __launch_bounds__(64) plain(float* p) { p[threadIdx.x] = 1.0f; }
__global__ void __launch_bounds__(64) vote(int* out, int lanes) {
  if (static_cast<int>(threadIdx.x % 32) >= lanes) return;
  if (__any_sync(0xffffffffu, threadIdx.x == 3)) __stwb(out + threadIdx.x, 1);
  else __stwb(out + threadIdx.x, 2);
}
__global__ void __launch_bounds__(64) oob(float* p, int n) { __stwb(p + n + threadIdx.x, 1.0f); }
"""


def test_tiny_kernels_faults_and_votes(module):
    mod = runtime.load(TINY, ["plain", "vote", "oob"], False, "tiny.cu")
    heap = mod.new_heap(1 << 20)
    heap.register(heap.base, 4096)
    ptr = (heap.base.to_bytes(8, "little"), "pointer", "ptr")

    def i32(v):
        return np.int32(v).tobytes(), "integer", "int"

    with pytest.raises(runtime.KernelFault, match="plain dereference of device memory"):
        mod.launch(heap, "plain", 1, 32, [ptr])
    mod.launch(heap, "vote", 1, 64, [ptr, i32(32)])  # a true vote: every lane sees lane 3
    assert heap.mem[:256].view(np.int32).tolist() == [1] * 32 + [2] * 32  # warp 1: no lane 3
    with pytest.raises(runtime.KernelFault, match="lane 16 exited without joining the vote"):
        mod.launch(heap, "vote", 1, 32, [ptr, i32(16)])
    with pytest.raises(runtime.KernelFault, match="past the end of the allocation"):
        mod.launch(heap, "oob", 1, 32, [ptr, i32(1020)])
    with pytest.raises(runtime.LaunchError, match="__launch_bounds__ allows 64"):
        mod.launch(heap, "oob", 1, 128, [ptr, i32(0)])
    with pytest.raises(runtime.LaunchError, match="argument 1 is int64 .*4-byte integer"):
        mod.launch(heap, "oob", 1, 32, [ptr, (np.int64(0).tobytes(), "integer", "int64")])
    with pytest.raises(runtime.LaunchError, match="1 arguments for 2 parameters"):
        mod.launch(heap, "oob", 1, 32, [ptr])


# ---------------------------------------------------------------------------------------------
# memcheck / racecheck / launch checks on the real kernels


def _small_table_args(cp, segs, bucket, chunk=256, itemsize=4):
    ptrs = np.array([p for p, _, _ in segs], np.uint64)
    offs = np.array([o for _, o, _ in segs], np.int64)
    sizes = np.array([n for _, _, n in segs], np.int64)
    tab = ck.build_table(ptrs, sizes, offs, chunk, itemsize)
    return tab, ck.backend().launch_args(tab, bucket, chunk, 1.0)


def test_memcheck_out_of_bounds_and_misaligned(cp):
    src = cp.asarray(np.ones(10, np.float32))
    bucket = cp.empty(64, np.float32)
    fn = ck.backend().function(0, "nd_pack_small<float, float, false>")
    tab, args = _small_table_args(cp, [(src.data.ptr, 0, 12)], bucket)
    with pytest.raises(runtime.KernelFault, match="Invalid __global__ read .* past the end"):
        fn((tab.grid,), (ck.THREADS,), args + (None,))
    tab, args = _small_table_args(cp, [(src.data.ptr + 2, 0, 4)], bucket)
    with pytest.raises(runtime.KernelFault, match="misaligned"):
        fn((tab.grid,), (ck.THREADS,), args + (None,))
    freed = cp.asarray(np.ones(8, np.float32))
    stale = freed.data.ptr
    del freed
    tab, args = _small_table_args(cp, [(stale, 0, 8)], bucket)
    with pytest.raises(runtime.KernelFault, match="not in any live allocation"):
        fn((tab.grid,), (ck.THREADS,), args + (None,))


def test_racecheck_overlapping_unpack_destinations_and_ldg_hazard(cp):
    dst = cp.asarray(np.zeros(600, np.float32))
    bucket = cp.asarray(np.ones(1200, np.float32))
    fn = ck.backend().function(0, "nd_unpack_small<float, float, true>")
    tab, args = _small_table_args(cp, [(dst.data.ptr, 0, 600), (dst.data.ptr + 400, 600, 500)], bucket)
    with pytest.raises(runtime.KernelFault, match=r"Race \((write-write|read-write|write-read)"):
        fn((tab.grid,), (ck.THREADS,), args + (None,))
    pk = ck.backend().function(0, "nd_pack_small<float, float, false>")
    tab, args = _small_table_args(cp, [(bucket.data.ptr, 100, 300)], bucket)
    with pytest.raises(runtime.KernelFault, match="__ldg hazard"):
        pk((tab.grid,), (ck.THREADS,), args + (None,))


def test_launch_argument_checks(cp):
    bucket = cp.empty(64, np.float32)
    src = cp.asarray(np.ones(10, np.float32))
    fn = ck.backend().function(0, "nd_pack_small<float, float, false>")
    tab, args = _small_table_args(cp, [(src.data.ptr, 0, 10)], bucket)
    fn((1,), (ck.THREADS,), args + (None,))
    bad = [
        (args[:2] + (np.int64(256),) + args[3:] + (None,), "argument 2 is numpy.int64"),
        (args[:3] + (np.float32(1),) + (None,), "argument 3 is numpy.float32"),
        (args + (None, None), "6 arguments for 5 parameters"),
        ((tab.small,) + args[1:] + (None,), None),  # size-1 structured ndarray: by value too
        ((np.zeros(1, [("x", "u1", 5000)]),) + args[1:] + (None,), "5000 bytes, struct"),
    ]
    for a, message in bad:
        if message is None:
            fn((1,), (ck.THREADS,), a)
            continue
        with pytest.raises(runtime.LaunchError, match=message):
            fn((1,), (ck.THREADS,), a)
    with pytest.raises(runtime.LaunchError, match="__launch_bounds__ allows 256"):
        fn((1,), (512,), args + (None,))
    big = runtime.load("struct Big { char b[5000]; };\n__global__ void k(Big b) {}\n", ["k"], False, "big.cu")
    heap = big.new_heap(1 << 16)
    with pytest.raises(runtime.LaunchError, match="5000 bytes of parameters exceed the 4096"):
        big.launch(heap, "k", 1, 32, [(bytes(5000), "struct", "Big")])


# ---------------------------------------------------------------------------------------------
# self-check: planted bugs must be caught


def _scenario(cp, kb, seed=0):
    """pack (with flag) then unpack (accumulate) of small and table layouts, misaligned and
    aligned tensors, subnormals and one inf off lane 0; raises when anything is off."""
    rng = np.random.default_rng(seed)
    for count in (3, 40):
        sizes = rng.integers(1, 600, count)
        sizes[0] = 37
        hosts = [(rng.standard_normal(int(n)) * 1e-38).astype(np.float32) for n in sizes]
        hosts[0][5] = np.inf if count == 3 else hosts[0][5]
        devs = [cp.asarray(h, misalign=4 * (i % 2)) for i, h in enumerate(hosts)]
        offs = (np.cumsum(sizes) - sizes).tolist()
        bucket = cp.asarray(np.full(int(sizes.sum()), np.nan, np.float32))
        want = np.full(int(sizes.sum()), np.nan, np.float32)
        flag, fref = cp.asarray(np.zeros(1, np.int32)), np.zeros(1, np.int32)
        kb.pack(devs, bucket, offs, 0.5, flag)
        K.pack_ref(hosts, want, offs, scale=0.5, nonfinite_flag=fref)
        np.testing.assert_array_equal(bucket.host().view(np.uint32), want.view(np.uint32))
        assert flag.host()[0] == fref[0]
        for h, d in zip(hosts, devs):  # same pointers, new values: a cached table
            h *= 2
            d.host()[...] = h
        kb.pack(devs, bucket, offs, 0.5, None)
        K.pack_ref(hosts, want, offs, scale=0.5)
        np.testing.assert_array_equal(bucket.host().view(np.uint32), want.view(np.uint32))
        hosts = [h * 3 for h in hosts]  # new arrays, same sizes: a new table
        devs = [cp.asarray(h, misalign=4 * (i % 2)) for i, h in enumerate(hosts)]
        kb.pack(devs, bucket, offs, 0.5, None)
        K.pack_ref(hosts, want, offs, scale=0.5)
        np.testing.assert_array_equal(bucket.host().view(np.uint32), want.view(np.uint32))
        outs = [
            cp.asarray(np.ones(int(n), np.float32), misalign=4 * (i % 3 == 1)) for i, n in enumerate(sizes)
        ]
        refs = [np.ones(int(n), np.float32) for n in sizes]
        kb.unpack(outs, bucket, offs, 0.25, True)
        K.unpack_ref(refs, want, offs, scale=0.25, accumulate=True)
        for o, r in zip(outs, refs):
            np.testing.assert_array_equal(o.host().view(np.uint32), r.view(np.uint32))
        x = (rng.standard_normal(1001) * 1e-38).astype(np.float32)
        d = cp.asarray(x)
        kb.scale_(d, 0.5)
        np.testing.assert_array_equal(d.host(), (x * np.float32(0.5)).astype(np.float32))


KERNEL_BUGS = {
    "tail index off by one": ("const int t = nvec * kVec + lane;", "const int t = nvec * kVec + lane + 1;"),
    "flush-to-zero multiply": ('asm("mul.rn.f32 %0, %1, %2;"', 'asm("mul.rn.ftz.f32 %0, %1, %2;"'),
    # plain C++ arithmetic compiles to .ftz under CuPy's -ftz=true: caught by its flushes
    "multiply without its PTX": ('asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));', "r = a * b;"),
    "half the warp skips the vote": (
        "if (__any_sync(0xffffffffu, bad) && lane == 0)",
        "if (lane < 16 && __any_sync(0xffffffffu, bad) && lane == 0)",
    ),
    "no vote (lane 0's own flag)": (
        "if (__any_sync(0xffffffffu, bad) && lane == 0)",
        "if (bad && lane == 0)",
    ),
    "items done twice (race)": (
        "item < nitems; item += warps)",
        "item < nitems; item += (warps > 1 ? warps / 2 : 1))",
    ),
    "vectors on 4-byte alignment": (
        "(reinterpret_cast<u64>(src) % sizeof(RS)) == 0",
        "(reinterpret_cast<u64>(src) % 4) == 0",
    ),
    "accumulate read through __ldg": (
        "if constexpr (kAccum) old[k].raw = __ldca(d + i);",
        "if constexpr (kAccum) old[k].raw = __ldg(d + i);",
    ),
    "small-table lookup off by one": ("if (item >= first_item[k]) {", "if (item > first_item[k]) {"),
    "scale reads past the end": (
        "for (i64 i = done + tid; i < n; i += stride) {",
        "for (i64 i = done + tid; i <= n; i += stride) {",
    ),
}

LAUNCH_BUGS = {
    "chunk passed as int64": ("np.int32(chunk), np.float64(scale))", "np.int64(chunk), np.float64(scale))"),
    "scale passed as float32": ("np.int32(chunk), np.float64(scale))", "np.int32(chunk), np.float32(scale))"),
    "unused small-table slots left 0": (
        'small["first_item"][0, k + 1 :] = nitems',
        'small["first_item"][0, k + 1 :] = 0',
    ),
    "item pointers in elements": (
        'items["ptr"] = ptrs[seg] + (start * itemsize).astype(np.uint64)',
        'items["ptr"] = ptrs[seg] + start.astype(np.uint64)',
    ),
    "table cache ignores pointers": (
        "CHUNK_BYTES, ptrs.tobytes(), sizes.tobytes()",
        "CHUNK_BYTES, sizes.tobytes()",
    ),
    "512 threads per block": ("THREADS = 256 ", "THREADS = 512 "),
    "SmallTable mirror one slot too big": ("SMALL_MAX = 32 ", "SMALL_MAX = 33 "),
}

NAMES = [
    "nd_pack<float, float, false>",
    "nd_pack<float, float, true>",
    "nd_pack_small<float, float, false>",
    "nd_pack_small<float, float, true>",
    "nd_unpack<float, float, true>",
    "nd_unpack_small<float, float, true>",
    "nd_scale<float>",
]


def _mutant_cuda_module(text):
    spec = importlib.util.spec_from_loader("nccl_ddp.kernels._mutant_cuda", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = CUDA_PY[0]
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    try:
        exec(compile(text, CUDA_PY[0], "exec"), mod.__dict__)  # noqa: S102 (our own source)
    finally:
        del sys.modules[spec.name]
    return mod


def _caught(fake, kb, monkeypatch, mod=ck):
    monkeypatch.setattr(mod, "_BACKEND", kb)
    try:
        _scenario(fake, kb)
    except (KernelError, AssertionError, runtime.LaunchError, runtime.KernelFault) as e:
        return str(e).splitlines()[0][:200] or type(e).__name__
    return None


@pytest.mark.slow
def test_planted_bugs_are_caught(module, monkeypatch):
    """Every planted bug makes the scenario fail (a sanitizer error, a refused launch or a wrong
    bit); the unmodified code passes it. The kernel copies are built in one library."""
    variants = {"ok": SOURCE}
    for i, (what, (old, new)) in enumerate(KERNEL_BUGS.items()):
        assert SOURCE.count(old) == 1, what
        variants[f"bug{i}"] = SOURCE.replace(old, new)
    mutants = runtime.load_variants(variants, NAMES, True)
    missed, seen = [], {}

    def run(what, kernels_module, prefix):
        fake = FakeCupy()
        fake.cpu_override = (mutants, prefix)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        seen[what] = _caught(fake, kernels_module.CudaKernels(fake), monkeypatch, kernels_module)
        if seen[what] is None and what != "unmodified":
            missed.append(what)

    run("unmodified", ck, "ok")
    assert seen["unmodified"] is None, seen["unmodified"]
    for i, what in enumerate(KERNEL_BUGS):
        run(what, ck, f"bug{i}")
    for what, (old, new) in LAUNCH_BUGS.items():
        assert CUDA_PY[1].count(old) == 1, what
        run(what, _mutant_cuda_module(CUDA_PY[1].replace(old, new)), "ok")
    print("\n".join(f"{k}: {v}" for k, v in seen.items()))
    assert missed == [], f"planted bugs not caught: {missed}"


@pytest.mark.slow
def test_build_is_cached_by_source_and_skips_without_a_compiler(module, monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_DDP_CPU_KERNEL_CACHE", str(tmp_path))
    src = "__global__ void k(int* p) { __stwb(p, 1); }\n"
    prog = translate.program(src, ["k"], False, "k.cu")
    lib = runtime.build(prog, "k.cu")
    assert lib.parent == tmp_path and lib.exists()
    calls = []
    real_run = runtime.subprocess.run
    monkeypatch.setattr(runtime.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert runtime.build(prog, "k.cu") == lib  # cached: no compile
    assert all("--version" in c for c in calls)
    assert runtime.build(translate.program(src + "\n", ["k"], False, "k.cu"), "k.cu") != lib
    # no compiler: the fake CuPy falls back to the references and says why
    monkeypatch.setattr(runtime, "compiler", lambda: None)
    monkeypatch.setattr(_fake_cupy, "CPU_KERNELS_MISSING", None)
    assert _fake_cupy.cpu_kernels() is None
    assert "no C++ compiler" in _fake_cupy.CPU_KERNELS_MISSING
    fake = FakeCupy()
    assert fake.cpu is None and fake.heap.dev is None
    with pytest.raises(runtime.BuildError, match="no C\\+\\+ compiler"):
        runtime.build(prog + "//", "k.cu")
