"""Bucket kernels on any machine: NVRTC/nvcc compiles of kernels/bucket.cu, the NumPy references
(the specification), the launch tables, and the whole CUDA path driven through a fake CuPy whose
"GPU" executes each launch from its raw arguments (tests/support/_fake_cupy.py)."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _fake_cupy import cupy_nvrtc_options
from kernel_checks import nvrtc_or_skip

from nccl_ddp import kernels as K
from nccl_ddp.errors import KernelError
from nccl_ddp.kernels import cuda as ck

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DT = {
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
SOURCE = (K.kernel_source_dir() / "bucket.cu").read_text()
MODULE = ck.module_source()  # bucket.cu + optim.cu: what NVRTC compiles
KERNELS = 52 + 18  # bucket + fused optimizer instantiations


def _nvrtc_compile(src, arch, names=(), extra=()):
    """Compile as CuPy 14.2 does: its exact NVRTC option list (-ftz=true after ours)."""
    nvrtc = nvrtc_or_skip()
    prog = nvrtc.createProgram(src, "bucket.cu", [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    version = tuple(nvrtc.getVersion())
    # --pch is opt-in (CUPY_NVRTC_USE_PCH=1): CuPy's default line has none
    options = list(cupy_nvrtc_options((*ck.COMPILE_OPTIONS, *extra), arch, version, use_pch=False))
    try:
        nvrtc.compileProgram(prog, list(options))
    except Exception as e:
        pytest.fail(f"NVRTC {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
    return nvrtc, prog


# ---------------------------------------------------------------------------------------------
# compiling


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
@pytest.mark.slow
def test_nvrtc_compiles_every_kernel_without_warnings(arch):
    names = ck.name_expressions()
    nvrtc, prog = _nvrtc_compile(MODULE, arch, names, ["-Xptxas=-v"])
    log = nvrtc.getProgramLog(prog).replace("\x00", "")
    lines = [ln for ln in log.splitlines() if ln.strip()]
    noise = re.compile(r"^ptxas(\s+info\s*:|\s+\.)")
    assert [ln for ln in lines if not noise.match(ln)] == [], log
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(entries) == len(names) == KERNELS
    assert "bytes stack frame" in log
    usage = re.findall(
        r"Function properties for (\w+)\s*\nptxas\s+\.\s+(\d+) bytes stack "
        r"frame, (\d+) bytes spill stores",
        log,
    )
    assert len(usage) == len(names)
    for fn, stack, spill in usage:  # float64 kernels (cold): ptxas may keep 8 bytes aside
        limit = 16 if "IddLb" in fn else 0
        assert int(stack) <= limit and int(spill) <= limit, f"{fn}: local memory used"
    lowered = {nvrtc.getLoweredName(prog, n) for n in names}
    assert len(lowered) == len(names) and set(entries) == lowered
    assert len(nvrtc.getCUBIN(prog)) > 10000


def _layout_asserts():
    checks = []
    for cname, dt in (("Seg", ck.SEG_DTYPE), ("SmallTable", ck.SMALL_DTYPE)):
        checks.append(f'static_assert(sizeof({cname}) == {dt.itemsize}, "size");')
        for field, (_, off) in dt.fields.items():
            checks.append(f'static_assert(offsetof({cname}, {field}) == {off}, "{cname}.{field}");')
    return "\n#include <cstddef>\n" + "\n".join(checks) + "\n"


def test_struct_sizes_match_the_python_mirrors():
    """bucket.cu static_asserts the sizes (offsets: the nvcc test, NVRTC lacks offsetof)."""
    assert ck.SEG_DTYPE.itemsize == 24
    assert ck.SMALL_DTYPE.itemsize == 24 * ck.SMALL_MAX + 4 * (ck.SMALL_MAX + 2) < 4096
    assert f"kSmallMax = {ck.SMALL_MAX}," in SOURCE and f"kThreads = {ck.THREADS}," in SOURCE
    _nvrtc_compile(SOURCE, "sm_90")


def test_aligned_spans_use_16_byte_vectors():
    names = [
        "nd_pack<float, float, false>",
        "nd_pack<float, bf16_t, true>",
        "nd_unpack<bf16_t, float, true>",
        "nd_pack_small<f16_t, f16_t, false>",
    ]
    nvrtc, prog = _nvrtc_compile(SOURCE, "compute_90", names)
    ptx = nvrtc.getPTX(prog).decode() if isinstance(nvrtc.getPTX(prog), bytes) else nvrtc.getPTX(prog)
    bodies = re.split(r"\.entry ", ptx)[1:]
    assert len(bodies) == len(names)
    for body in bodies:
        assert re.search(r"(ld\.global\.nc|st\.global\.wb)\.v4\.", body), body[:120]
        generic = re.findall(r"\b(?:ld|st)\.(?:v\d\.)?[usbf]\d+\b", body)
        assert generic == [], f"generic (not .global) accesses: {generic[:4]}"
        assert ".local" not in body


@pytest.mark.slow
def test_no_flush_to_zero_instruction_under_cupys_options():
    """CuPy appends -ftz=true: the float32 arithmetic and conversions must still keep
    subnormals (inline PTX without .ftz), in every instantiation."""
    nvrtc, prog = _nvrtc_compile(MODULE, "compute_90", ck.name_expressions())
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert "-ftz=true" in cupy_nvrtc_options(ck.COMPILE_OPTIONS)
    assert ptx.count(".entry ") == KERNELS
    assert re.findall(r"^\s*\S*\.ftz\S*", ptx, re.MULTILINE) == []
    assert re.search(r"\bmul\.rn\.f32\b", ptx) and re.search(r"\badd\.rn\.f32\b", ptx)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.slow
def test_nvcc_compiles_with_all_warnings_as_errors(tmp_path):
    inst = tmp_path / "inst.cu"
    refs = ",\n".join(f"  reinterpret_cast<const void*>(&{n})" for n in ck.name_expressions())
    inst.write_text(
        MODULE
        + _layout_asserts()
        + f"\nextern const void* const kAll[];\nconst void* const kAll[] = {{\n{refs}\n}};\n"
    )
    cmd = [
        "nvcc",
        "-std=c++17",
        "-arch=sm_90",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-v",
        "-c",
        str(inst),
        "-o",
        str(tmp_path / "inst.o"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", out)
    assert len(usage) == KERNELS and set(usage) == {("0", "0")}, out
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", out)]
    assert max(regs) <= 128  # 256-thread blocks keep >= 2 blocks per SM


# ---------------------------------------------------------------------------------------------
# NumPy references


def _eq(got, want):
    """Exact equality, NaN == NaN (compared as float64: exact for every dtype here)."""
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64))


def _rand(rng, n, name, lo=-4.0, hi=4.0):
    return rng.uniform(lo, hi, n).astype(DT[name])


def _layout(rng, sizes, align_elems, gap=True):
    """Offsets for `sizes`, each a multiple of align_elems (1: misaligned), with random gaps."""
    offs, pos = [], 0
    for n in sizes:
        pos += int(rng.integers(0, 3)) if gap else 0
        pos = -(-pos // align_elems) * align_elems
        offs.append(pos)
        pos += n
    return offs, pos + 5


def _expected_pack(srcs, offs, total, bname, scale, poison):
    acc = np.float64 if bname == "float64" else np.float32
    out = np.full(total, poison, dtype=DT[bname])
    with np.errstate(over="ignore", invalid="ignore"):
        for x, o in zip(srcs, offs):
            out[o : o + x.size] = (x.reshape(-1).astype(acc) * acc(scale)).astype(DT[bname])
    return out


@pytest.mark.parametrize("pair", sorted(K.PACK_PAIRS))
def test_pack_ref_places_scales_and_casts(pair):
    rng = np.random.default_rng(len(pair[0]) * 7 + len(pair[1]))
    sizes = [1, 7, 0, 33, 1000, 3, 0, 129]
    offs, total = _layout(rng, sizes, 1)
    srcs = [_rand(rng, n, pair[0]).reshape((n,) if n % 3 else (1, n)) for n in sizes]
    bucket = np.full(total, np.nan, dtype=DT[pair[1]])
    K.pack(srcs, bucket, offs, scale=0.25)
    want = _expected_pack(srcs, offs, total, pair[1], 0.25, np.nan)
    _eq(bucket, want)
    covered = np.zeros(total, bool)
    for o, n in zip(offs, sizes):
        covered[o : o + n] = True
    assert np.isnan(bucket[~covered].astype(np.float64)).all()  # gaps untouched
    assert not np.isnan(bucket[covered].astype(np.float64)).any()  # every element written


def test_pack_ref_rounds_once_to_nearest_even():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, 70000.0, -1e-45], np.float32)
    b = np.zeros(5, BF16)
    K.pack([x], b, [0])
    assert b.astype(np.float32).tolist() == [1.0, 1.015625, 1.0, 70144.0, -0.0]
    h = np.zeros(5, np.float16)
    flag = np.zeros(1, np.int32)
    K.pack([x], h, [0], nonfinite_flag=flag)
    assert np.isinf(h[3]) and flag[0] == 1  # 70000 overflows float16: the flag sees the cast


@pytest.mark.parametrize("pair", sorted(K.UNPACK_PAIRS))
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack_ref_scatters_and_accumulates(pair, accumulate):
    rng = np.random.default_rng(3)
    sizes = [5, 0, 64, 1, 300]
    offs, total = _layout(rng, sizes, 1)
    bucket = _rand(rng, total, pair[0])
    dsts = [_rand(rng, n, pair[1]) for n in sizes]
    before = [d.copy() for d in dsts]
    K.unpack(dsts, bucket, offs, scale=0.5, accumulate=accumulate)
    acc = np.float64 if "float64" in pair else np.float32
    for d, b0, o, n in zip(dsts, before, offs, sizes):
        v = bucket[o : o + n].astype(acc) * acc(0.5)
        if accumulate:
            v = b0.astype(acc) + v
        _eq(d, v.astype(DT[pair[1]]))


def test_pack_unpack_roundtrip_10000_small_tensors_misaligned_offsets():
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 9, 10_000)
    offs, total = _layout(rng, sizes, 1)
    srcs = [_rand(rng, int(n), "float32") for n in sizes]
    bucket = np.full(total, np.nan, np.float32)
    flag = np.zeros(1, np.int32)
    K.pack(srcs, bucket, offs, nonfinite_flag=flag)
    assert flag[0] == 0
    outs = [np.full(int(n), np.nan, np.float32) for n in sizes]
    K.unpack(outs, bucket, offs)
    for s, o in zip(srcs, outs):
        np.testing.assert_array_equal(s, o)


def test_pack_one_huge_tensor_and_scale_zero():
    x = np.random.default_rng(6).standard_normal(3_000_017).astype(np.float32)
    b = np.empty(x.size + 3, np.float32)
    K.pack([x], b, [3], scale=1 / 3)
    np.testing.assert_array_equal(b[3:], x * np.float32(1 / 3))
    K.scale_(b, 3.0)
    np.testing.assert_array_equal(b[3:], (x * np.float32(1 / 3)) * np.float32(3.0))
    K.zero_(b)
    assert not b.any()


@pytest.mark.parametrize("name", sorted(K.SCALE_DTYPES))
def test_scale_ref_every_dtype(name):
    x = _rand(np.random.default_rng(7), 1001, name)
    y = x.copy()
    K.scale_(y, 0.125)
    acc = np.float64 if name == "float64" else np.float32
    _eq(y, (x.astype(acc) * acc(0.125)).astype(DT[name]))


def test_nonfinite_flag_set_only_when_seen_and_never_cleared():
    a = np.ones(10, np.float32)
    b = np.ones(5, np.float32)
    bucket = np.zeros(16, BF16)
    flag = np.zeros(1, np.int32)
    K.pack([a, b], bucket, [0, 10], nonfinite_flag=flag)
    assert flag[0] == 0
    b[2] = np.inf
    K.pack([a, b], bucket, [0, 10], nonfinite_flag=flag)
    assert flag[0] == 1
    b[2] = 1.0
    K.pack([a, b], bucket, [0, 10], nonfinite_flag=flag)
    assert flag[0] == 1
    a[9] = np.nan
    K.zero_(flag)
    K.pack([a, b], bucket, [0, 10], nonfinite_flag=flag)
    assert flag[0] == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: K.pack([np.ones(4, np.float16)], np.zeros(8, np.float32), [0]),
            "dtype pair float16->float32 is not supported",
        ),
        (
            lambda: K.unpack([np.ones(4, np.float16)], np.zeros(8, np.float32), [0]),
            "dtype pair float32->float16 is not supported",
        ),
        (
            lambda: K.pack([np.ones(4, np.float32)], np.zeros(8, np.float32), [5]),
            "ends past the bucket (8 elements)",
        ),
        (
            lambda: K.pack([np.ones((4, 4), np.float32)[:, 1]], np.zeros(8, np.float32), [0]),
            "array 0 (shape (4,), strides (16,)) is not contiguous",
        ),
        (
            lambda: K.pack([np.ones(4, np.float32)] * 2, np.zeros(8, np.float32), [0, 3]),
            "arrays 0 and 1 overlap",
        ),
        (lambda: K.pack([np.ones(4, np.float32)], np.zeros(8, np.float32), [0, 4]), "1 arrays but 2 offsets"),
        (lambda: K.pack([np.ones(4, np.float32)], np.zeros(8, np.float32), [-1]), "offset 0 is negative"),
        (
            lambda: K.pack([np.ones(4, np.float32), np.ones(2, np.float64)], np.zeros(8, np.float32), [0, 4]),
            "array 1 is float64 but array 0 is float32",
        ),
        (
            lambda: K.pack(
                [np.ones(4, np.float32)], np.zeros(8, np.float32), [0], nonfinite_flag=np.zeros(1, np.float32)
            ),
            "nonfinite_flag must be an int32",
        ),
        (lambda: K.scale_(np.ones(4, np.int32), 2.0), "scale_: dtype int32 is not supported"),
        (lambda: K.scale_(np.ones((4, 4), np.float32)[:, 0], 2.0), "is not contiguous"),
    ],
)
def test_errors_name_the_kernel_and_argument(call, message):
    with pytest.raises(KernelError, match=re.escape(message)):
        call()


def test_unpack_allows_overlapping_bucket_ranges():
    bucket = np.arange(6, dtype=np.float32)
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
    K.unpack([a, b], bucket, [0, 2])
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [2, 3, 4, 5]


def test_kernel_source_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DDP_KERNEL_DIR", str(tmp_path))
    assert K.kernel_source_dir() != tmp_path  # no bucket.cu there: fall through
    (tmp_path / "bucket.cu").write_text("//")
    assert K.kernel_source_dir() == tmp_path


def test_importing_kernels_and_device_does_not_import_cupy():
    code = (
        "import sys, nccl_ddp.kernels, nccl_ddp.device, nccl_ddp.kernels.cuda;"
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# launch tables


def _cover(tab, chunk, itemsize):
    """(tensor index, start, length, bucket offset) of every item, decoded the way bucket.cu's
    find() does; tensors sit at (i + 1) << 20."""
    out = []
    for item in range(tab.nitems):
        if tab.small is not None:
            s = tab.small[0]
            t = max(k for k in range(ck.SMALL_MAX) if item >= s["first_item"][k])
            start = (item - int(s["first_item"][t])) * chunk
            ptr, off, n = (
                int(s["ptr"][t]) + start * itemsize,
                int(s["off"][t]) + start,
                min(chunk, int(s["n"][t]) - start),
            )
        else:
            it = tab.items[item]
            ptr, off, n = int(it["ptr"]), int(it["off"]), int(it["n"])
        i = (ptr >> 20) - 1
        out.append((i, (ptr - ((i + 1) << 20)) // itemsize, n, off))
    return out


@pytest.mark.parametrize("count, small", [(1, True), (32, True), (33, False), (10_000, False)])
def test_build_table_covers_every_element_once(count, small):
    rng = np.random.default_rng(count)
    sizes = rng.integers(0, 5000, count).astype(np.int64)
    sizes[::7] = 0
    ptrs = (np.arange(count, dtype=np.uint64) + 1) * np.uint64(1 << 20)
    offs = np.cumsum(sizes) - sizes + 3
    chunk, itemsize = 1024, 4
    tab = ck.build_table(ptrs, sizes, offs, chunk, itemsize)
    assert (tab.small is not None) == (np.count_nonzero(sizes) <= ck.SMALL_MAX)
    assert tab.nitems == int((-(-sizes // chunk)).sum())
    assert tab.grid * ck.WARPS_PER_BLOCK >= tab.nitems
    assert tab.nitems == 0 or tab.nitems > (tab.grid - 1) * ck.WARPS_PER_BLOCK
    spans = {}
    for i, start, n, off in _cover(tab, chunk, itemsize):
        assert 0 < n <= chunk and start % chunk == 0 and off == offs[i] + start
        spans.setdefault(i, []).append((start, n))
    for i in range(count):
        got = sorted(spans.get(i, []))
        assert sum(n for _, n in got) == sizes[i]
        assert [s for s, _ in got] == list(range(0, int(sizes[i]), chunk))


@pytest.mark.parametrize(
    "sizes", [[6_553_600], [65_536] * 100, [1] * 4000 + [2_000_000], list(range(1, 3000)), [7, 0, 5]]
)
def test_choose_chunk_fills_one_wave(sizes):
    sizes = np.array(sizes, np.int64)
    warps = 132 * 4 * 8
    chunk = ck.choose_chunk(sizes, ("float32", "float32"), warps)
    items = int((-(-sizes // chunk)).sum())
    assert chunk % 16 == 0 and chunk >= ck.MIN_CHUNK
    assert items <= warps  # one wave
    if chunk > ck.MIN_CHUNK:  # and the smallest such chunk
        assert int((-(-sizes // (chunk - 16))).sum()) > warps
    if len(sizes) == 1:
        assert items > 0.97 * warps  # one tensor: spread on every warp


def test_choose_chunk_many_tensors_and_fixed(monkeypatch):
    many = np.full(20_000, 300, np.int64)
    assert ck.choose_chunk(many, ("float32", "bfloat16"), 4224) == 2048
    monkeypatch.setattr(ck, "CHUNK_BYTES", 16384)
    assert ck.choose_chunk(np.array([10**6]), ("float16", "float16"), 4224) == 8192


def test_small_table_bytes_are_what_the_kernel_reads():
    tab = ck.build_table(
        np.array([0x1000, 0x2004], np.uint64),
        np.array([3, 5000], np.int64),
        np.array([0, 16], np.int64),
        2048,
        4,
    )
    raw = tab.small.tobytes()
    assert len(raw) == 24 * ck.SMALL_MAX + 4 * (ck.SMALL_MAX + 2)
    words = np.frombuffer(raw[: 24 * ck.SMALL_MAX], "<u8")
    assert words[0] == 0x1000 and words[1] == 0x2004  # ptr[]
    assert words[ck.SMALL_MAX + 1] == 16 and words[2 * ck.SMALL_MAX + 1] == 5000  # off[], n[]
    ints = np.frombuffer(raw[24 * ck.SMALL_MAX :], "<i4")
    assert ints[:4].tolist() == [0, 1, 4, 4] and ints[-1] == 2  # first_item, nseg


def test_kernel_names():
    assert ck.kernel_name("pack", ("float32", "bfloat16"), True, False) == "nd_pack<float, bf16_t, true>"
    assert (
        ck.kernel_name("unpack", ("float16", "float32"), False, True)
        == "nd_unpack_small<f16_t, float, false>"
    )
    assert len(set(ck.name_expressions())) == KERNELS
    assert ck.optim_kernel_name("adamw", "bfloat16", "float16") == "nd_adamw<bf16_t, f16_t>"
