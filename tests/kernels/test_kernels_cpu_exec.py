"""The real kernels/bucket.cu executed on the CPU (tests/support/cuda_cpu) through the project's launch path
on the fake CuPy: randomised cases bit for bit against pack_ref/unpack_ref/scale_ref for every
kernel instantiation, the memory/race/vote/launch checks of the CPU build, and the software PTX
against NumPy."""

import _fake_cupy
import numpy as np
import pytest

from nccl_ddp import kernels as K
from nccl_ddp.kernels import cuda as ck
from nccl_ddp.kernels.spec import PACK_PAIRS, SCALE_DTYPES, UNPACK_PAIRS

ml_dtypes = pytest.importorskip("ml_dtypes")
# the generator the GPU check uses too (scripts/gpu_kernel_cases.py): a GPU failure replays here
from kernel_cases import DT, SCALES, values  # noqa: E402
from kernel_cases import sizes as _sizes  # noqa: E402
from kernel_checks import assert_bits_equal, fake_cupy_installed  # noqa: E402

BF16 = DT["bfloat16"]


def _pack_case(cp, rng, pair, flag, count, misalign):
    src_t, bkt_t = pair
    sizes = _sizes(rng, count)
    nonfinite = flag and bool(rng.integers(0, 2))
    hosts = [values(rng, int(n), src_t, nonfinite=nonfinite and i % 5 == 1) for i, n in enumerate(sizes)]
    item = DT[src_t].itemsize
    devs = [
        cp.asarray(h, misalign=(item * int(rng.integers(1, 8)) if misalign and i % 3 else 0))
        for i, h in enumerate(hosts)
    ]
    gaps = rng.integers(0, 3, count)  # odd bucket offsets, gaps left unwritten
    offs = (np.cumsum(sizes + gaps) - sizes).tolist()
    total = int(offs[-1] + sizes[-1] + 5) if count else 5
    fill = np.full(total, np.nan, DT[bkt_t])
    scale = float(rng.choice(SCALES))
    bucket = cp.asarray(fill)
    want = fill.copy()
    f_dev = cp.asarray(np.zeros(1, np.int32)) if flag else None
    f_ref = np.zeros(1, np.int32) if flag else None
    K.pack_ref(hosts, want, offs, scale=scale, nonfinite_flag=f_ref)
    K.pack(devs, bucket, offs, scale=scale, nonfinite_flag=f_dev)
    assert_bits_equal(bucket.host(), want, f"pack {pair} K={count} scale={scale}")
    if flag:
        assert f_dev.host()[0] == f_ref[0]
    return hosts, devs, offs, bucket, want


@pytest.mark.parametrize("pair", sorted(PACK_PAIRS))
@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("count", [1, 7, 32, 33, 257])
def test_pack_random_bit_exact(cp, pair, flag, count):
    rng = np.random.default_rng([count, flag, *map(len, pair)])
    _pack_case(cp, rng, pair, flag, count, misalign=count % 2 == 1)
    small = count <= ck.SMALL_MAX
    assert cp.launches[-1][0] == ck.kernel_name("pack", pair, flag, small)


@pytest.mark.parametrize("pair", sorted(UNPACK_PAIRS))
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("count", [1, 5, 32, 40])
def test_unpack_random_bit_exact(cp, pair, accumulate, count):
    bkt_t, dst_t = pair
    rng = np.random.default_rng([count, accumulate, *map(len, pair)])
    sizes = _sizes(rng, count)
    offs = (np.cumsum(sizes + rng.integers(0, 3, count)) - sizes).tolist()
    bucket_h = values(rng, int(offs[-1] + sizes[-1] + 3), bkt_t, nonfinite=True)
    bucket = cp.asarray(bucket_h)
    item = DT[dst_t].itemsize
    inits = [values(rng, int(n), dst_t) for n in sizes]
    outs = [cp.asarray(h, misalign=item * (i % 3)) for i, h in enumerate(inits)]
    want = [h.copy() for h in inits]
    scale = float(rng.choice(SCALES))
    K.unpack_ref(want, bucket_h, offs, scale=scale, accumulate=accumulate)
    K.unpack(outs, bucket, offs, scale=scale, accumulate=accumulate)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert_bits_equal(o.host(), w, f"unpack {pair} tensor {i}")
    assert cp.launches[-1][0] == ck.kernel_name("unpack", pair, accumulate, count <= ck.SMALL_MAX)


@pytest.mark.parametrize("pair", sorted(UNPACK_PAIRS))
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("count", [5, 40])
def test_unpack_nonfinite_flag_random_bit_exact(cp, pair, accumulate, count):
    """The checked unpack (issue 22 item 1): same bits as the reference, and the flag raised
    exactly when a written value is NaN/Inf (a non-finite reduced value, or one the scale or
    the accumulation overflows), never when all are finite."""
    bkt_t, dst_t = pair
    rng = np.random.default_rng([count, accumulate, 7, *map(len, pair)])
    for nonfinite in (False, True):
        sizes = _sizes(rng, count)
        offs = (np.cumsum(sizes + rng.integers(0, 3, count)) - sizes).tolist()
        bucket_h = values(rng, int(offs[-1] + sizes[-1] + 3), bkt_t, special=False, nonfinite=nonfinite)
        if not nonfinite:  # only finite values written (the +3 tail is never read)
            bucket_h[:] = np.nan_to_num(bucket_h.astype(np.float64), posinf=1.0, neginf=-1.0).astype(
                DT[bkt_t]
            )
        bucket = cp.asarray(bucket_h)
        inits = [values(rng, int(n), dst_t, special=False) for n in sizes]
        outs = [cp.asarray(h, misalign=DT[dst_t].itemsize * (i % 3)) for i, h in enumerate(inits)]
        want = [h.copy() for h in inits]
        f_dev, f_ref = cp.asarray(np.zeros(1, np.int32)), np.zeros(1, np.int32)
        K.unpack_ref(want, bucket_h, offs, scale=0.5, accumulate=accumulate, nonfinite_flag=f_ref)
        K.unpack(outs, bucket, offs, scale=0.5, accumulate=accumulate, nonfinite_flag=f_dev)
        for i, (o, w) in enumerate(zip(outs, want)):
            assert_bits_equal(o.host(), w, f"checked unpack {pair} tensor {i}")
        written_bad = any(not np.isfinite(w.astype(np.float64)).all() for w in want)
        assert int(f_dev.host()[0]) == int(f_ref[0]) == int(written_bad), (nonfinite, f_ref)
        assert cp.launches[-1][0] == ck.kernel_name("unpack", pair, accumulate, count <= ck.SMALL_MAX)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unpack_flags_finite_values_it_overflows(cp, dtype):
    # 3e38 (f32) or 6e4 (f16) in the bucket, scale 4: the written value is inf, the read one not
    big = {"float32": 3e38, "float16": 6e4}[dtype]
    bucket_h = np.array([1.0, big, 2.0], DT[dtype])
    out = cp.asarray(np.zeros(3, DT[dtype]))
    flag = cp.asarray(np.zeros(1, np.int32))
    K.unpack([out], cp.asarray(bucket_h), [0], scale=4.0, nonfinite_flag=flag)
    assert np.isinf(out.host()[1]) and int(flag.host()[0]) == 1
    ok = cp.asarray(np.zeros(1, np.int32))
    K.unpack([out], cp.asarray(bucket_h), [0], scale=0.25, nonfinite_flag=ok)
    assert int(ok.host()[0]) == 0 and int(flag.host()[0]) == 1  # set only, never cleared


@pytest.mark.slow
def test_thousands_of_tensors_both_table_kinds_and_cached_tables(cp):
    rng = np.random.default_rng(7)
    for count in (3000, 31):
        hosts, devs, offs, bucket, want = _pack_case(
            cp, rng, ("float32", "bfloat16"), True, count, misalign=True
        )
        builds = ck.backend().stats["table_builds"]
        for h, d in zip(hosts, devs):  # new values, same pointers: the cached table serves
            h[...] = values(rng, h.size, "float32")
            d.host()[...] = h
        f_dev, f_ref = cp.asarray(np.zeros(1, np.int32)), np.zeros(1, np.int32)
        K.pack(devs, bucket, offs, scale=0.25, nonfinite_flag=f_dev)
        K.pack_ref(hosts, want, offs, scale=0.25, nonfinite_flag=f_ref)
        assert ck.backend().stats["table_builds"] == builds
        assert_bits_equal(bucket.host(), want, f"cached table K={count}")
        assert f_dev.host()[0] == f_ref[0]
        outs = [cp.asarray(np.ones(h.size, np.float32)) for h in hosts]
        wants = [np.ones(h.size, np.float32) for h in hosts]
        K.unpack(outs, bucket, offs, scale=4.0, accumulate=True)
        K.unpack_ref(wants, want, offs, scale=4.0, accumulate=True)
        for o, w in zip(outs, wants):
            assert_bits_equal(o.host(), w, "unpack after cached pack")


def test_few_multiprocessors_many_items_per_warp_and_big_chunks(cp, monkeypatch):
    """One SM: 32 resident warps, so chunks grow to cover big tensors in one wave, and many
    tensors share each warp's item loop."""
    monkeypatch.setitem(_fake_cupy.FAKE_STATE, "sms", 1)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    rng = np.random.default_rng(11)
    _pack_case(cp, rng, ("float32", "float32"), True, 5, misalign=True)
    _pack_case(cp, rng, ("float64", "float64"), False, 300, misalign=False)


@pytest.mark.parametrize("pair", [("float32", "float32"), ("float32", "float16"), ("float64", "float64")])
@pytest.mark.parametrize("grid", [1, 2])
def test_grid_smaller_than_the_item_count(cp, pair, grid):
    """Direct launches with fewer warps than items: each warp's grid-stride item loop."""
    rng = np.random.default_rng(grid)
    for count in (4, 40):
        sizes = rng.integers(1, 700, count)
        hosts = [values(rng, int(n), pair[0]) for n in sizes]
        devs = [cp.asarray(h, misalign=DT[pair[0]].itemsize * (i % 2)) for i, h in enumerate(hosts)]
        offs = (np.cumsum(sizes) - sizes).tolist()
        bucket = cp.asarray(np.full(int(sizes.sum()), np.nan, DT[pair[1]]))
        kb = ck.backend()
        offs_a = np.asarray(offs, np.int64)
        tab, chunk = kb.table("pack", pair, devs, bucket, sizes.astype(np.int64), offs_a)
        chunk = 64  # many items; rebuild the table with small chunks
        itemsize = DT[pair[0]].itemsize
        ptrs = np.array([d.data.ptr for d in devs], np.uint64)
        tab = ck.build_table(ptrs, sizes.astype(np.int64), offs_a, chunk, itemsize)
        if tab.small is None:
            tab.device_buf = cp.asarray(tab.items.view(np.uint8))
        assert tab.nitems > grid * ck.WARPS_PER_BLOCK
        flag = cp.asarray(np.zeros(1, np.int32))
        name = ck.kernel_name("pack", pair, True, tab.small is not None)
        kb.function(0, name)((grid,), (ck.THREADS,), kb.launch_args(tab, bucket, chunk, 0.5) + (flag,))
        want = np.full(int(sizes.sum()), np.nan, DT[pair[1]])
        K.pack_ref(hosts, want, offs, scale=0.5)
        assert_bits_equal(bucket.host(), want, f"grid {grid}, {tab.nitems} items")


@pytest.mark.parametrize("dtype", sorted(SCALE_DTYPES))
@pytest.mark.parametrize("sms", [1, 132])
def test_scale_random_bit_exact(cp, monkeypatch, dtype, sms):
    monkeypatch.setitem(_fake_cupy.FAKE_STATE, "sms", sms)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    rng = np.random.default_rng(sms)
    for n, mis in ((1, 0), (13, 1), (40_001, 0), (5003, 3)):
        x = values(rng, n, dtype, nonfinite=True)
        d = cp.asarray(x, misalign=DT[dtype].itemsize * mis)
        f = float(rng.choice(SCALES))
        K.scale_(d, f)
        want = x.copy()
        K.scale_ref(want, f)
        assert_bits_equal(d.host(), want, f"scale {dtype} n={n} factor={f}")


@pytest.mark.parametrize("pair", [("float32", "float32"), ("float32", "bfloat16"), ("float32", "float16")])
def test_float32_subnormals_survive_cuda_ftz(cp, pair):
    """CuPy compiles with -ftz=true (last on NVRTC's line): float32 arithmetic must not flush.
    Subnormal inputs, outputs made subnormal by the scale, -0.0."""
    tiny = np.array(
        [2.0**-149, -(2.0**-140), 1e-39, -1e-40, 2.0**-126, -0.0, 0.0, 1e-30, 3e-38, 1.5e-38] * 7, np.float32
    )
    bucket = cp.asarray(np.full(tiny.size, np.nan, DT[pair[1]]))
    K.pack([cp.asarray(tiny)], bucket, [0], scale=0.5)
    want = np.full(tiny.size, np.nan, DT[pair[1]])
    K.pack_ref([tiny], want, [0], scale=0.5)
    assert_bits_equal(bucket.host(), want, "pack of subnormals")
    if pair[1] == "float32":
        assert (bucket.host().view(np.uint32)[1:5] & 0x7FFFFFFF != 0).all()  # not flushed
    out = cp.asarray(np.full(tiny.size, 1e-39, np.float32))
    K.unpack([out], bucket, [0], scale=1e-3, accumulate=True)
    ref = np.full(tiny.size, 1e-39, np.float32)
    K.unpack_ref([ref], want, [0], scale=1e-3, accumulate=True)
    assert_bits_equal(out.host(), ref, "accumulate of subnormals")


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("world", [2, 4])
def test_narrowing_pack_rounds_as_torch_compress_hooks(monkeypatch, wire, world):
    """torch's fp16/bf16_compress_hook: `buffer.to(wire).div_(world)` (round to the wire dtype,
    then divide in it). Means in float16's subnormal range (and past its largest finite value)
    round as torch's do, in the kernel and in the reference (both scaled-then-cast before)."""
    torch = pytest.importorskip("torch")  # before the fake CuPy (torch probes cupyx)
    cp = fake_cupy_installed(monkeypatch)
    rng = np.random.default_rng(world)
    x = (rng.standard_normal(4096) * 2.0 ** rng.integers(-27, -12, 4096)).astype(np.float32)
    x[:4] = [70000.0, -65519.0, 2.0**-25 * 3, 2.0**-24 * 1.5]
    t = torch.from_numpy(x.copy()).to(getattr(torch, wire)).div_(world)
    want = t.view(torch.int16).numpy().view(DT[wire]) if wire == "bfloat16" else t.numpy()
    ref = np.full(x.size, np.nan, DT[wire])
    K.pack_ref([x], ref, [0], scale=1.0 / world)
    assert_bits_equal(ref, want, f"pack_ref {wire} world {world} vs torch")
    bucket = cp.asarray(np.full(x.size, np.nan, DT[wire]))
    K.pack([cp.asarray(x)], bucket, [0], scale=1.0 / world)
    assert_bits_equal(bucket.host(), want, f"pack kernel {wire} world {world} vs torch")
