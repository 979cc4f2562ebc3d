"""Bucket kernels on a real GPU against their NumPy references: fresh random data, outputs
poisoned first, every dtype pair, 1/100/10,000 tensors, misaligned sources, the table cache,
one launch per call, and stream ordering through events (no host sync in between)."""

import io

import numpy as np
import pytest

from nccl_ddp import kernels as K
from nccl_ddp.kernels import cuda as ck

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DT = {
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


def to_dev(h):
    return cp.asarray(np.ascontiguousarray(h))


def poison(d):
    """Fill a device array with NaN (bf16 through its bits: CuPy has no bf16 arithmetic)."""
    if d.dtype == BF16:
        d.view(cp.uint16).fill(0x7FC0)
    else:
        d.fill(np.nan)


def to_host(d):
    return cp.asnumpy(d)


def eq(got, want):
    """Exact, NaN == NaN (as float64, exact for every dtype here)."""
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64))


def make_sources(rng, count, dtype, misalign):
    """`count` device arrays (views into one allocation; every other one starts one element
    past a 16-byte boundary when `misalign`) plus their host copies and packed offsets."""
    sizes = rng.integers(0, 300, count) if count > 100 else rng.integers(1, 70_000, count)
    if count > 2:
        sizes[1] = 0
    hosts = [rng.uniform(-3, 3, int(n)).astype(DT[dtype]) for n in sizes]
    starts, pos = [], 0
    for i, n in enumerate(sizes):
        pos = -(-pos // 16) * 16 + (1 if misalign and i % 2 else 0)
        starts.append(pos)
        pos += int(n)
    flat = np.zeros(pos + 1, DT[dtype])
    for h, s in zip(hosts, starts):
        flat[s : s + h.size] = h
    base = to_dev(flat)
    devs = [base[s : s + h.size] for h, s in zip(hosts, starts)]
    align = 16 // DT[dtype].itemsize
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-int(n) // align) * align  # 16-byte aligned bucket offsets
    return hosts, devs, offs, pos + align


@pytest.mark.parametrize("count", [1, 100, 10_000])
@pytest.mark.parametrize("pair", sorted(K.PACK_PAIRS))
def test_pack_matches_reference(pair, count):
    rng = np.random.default_rng()
    hosts, devs, offs, total = make_sources(rng, count, pair[0], misalign=count != 1)
    bucket = to_dev(np.full(total, np.nan, DT[pair[1]]))
    flag = cp.zeros(1, cp.int32)
    stats = ck.backend().stats
    before = stats["launches"]
    K.pack(devs, bucket, offs, scale=1 / 3, nonfinite_flag=flag)
    assert stats["launches"] - before == 1
    want = np.full(total, np.nan, DT[pair[1]])
    want_flag = np.zeros(1, np.int32)
    K.pack_ref(hosts, want, offs, scale=1 / 3, nonfinite_flag=want_flag)
    eq(to_host(bucket), want)
    assert int(flag.get()[0]) == int(want_flag[0]) == 0
    # a NaN in the last non-empty tensor sets the flag (and nothing else changes)
    last = max(i for i, h in enumerate(hosts) if h.size)
    poison(devs[last][-1:])
    K.pack(devs, bucket, offs, scale=1 / 3, nonfinite_flag=flag)
    assert int(flag.get()[0]) == 1


@pytest.mark.parametrize("count", [1, 100, 10_000])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("pair", sorted(K.UNPACK_PAIRS))
def test_unpack_matches_reference(pair, accumulate, count):
    rng = np.random.default_rng()
    hosts, devs, offs, total = make_sources(rng, count, pair[1], misalign=count != 1)
    if not accumulate:
        for d in devs:
            poison(d)
        hosts = [np.full(h.shape, np.nan, DT[pair[1]]) for h in hosts]
    bucket_h = rng.uniform(-3, 3, total).astype(DT[pair[0]])
    bucket = to_dev(bucket_h)
    stats = ck.backend().stats
    before = stats["launches"]
    K.unpack(devs, bucket, offs, scale=0.75, accumulate=accumulate)
    assert stats["launches"] - before == 1
    K.unpack_ref(hosts, bucket_h, offs, scale=0.75, accumulate=accumulate)
    for d, h in zip(devs, hosts):
        eq(to_host(d), h)


@pytest.mark.parametrize("count", [1, 100])
@pytest.mark.parametrize("pair", sorted(K.UNPACK_PAIRS))
def test_checked_unpack_and_flag_nonfinite_match_reference(pair, count):
    """check_finite's GPU half (issue 22 item 1): the unpack's flag and flag_nonfinite against
    the references, on clean buckets and on buckets holding one inf."""
    rng = np.random.default_rng()
    for bad in (False, True):
        hosts, devs, offs, total = make_sources(rng, count, pair[1], misalign=count != 1)
        bucket_h = rng.uniform(-3, 3, total).astype(DT[pair[0]])
        if bad:
            bucket_h[offs[-1]] = np.inf
        bucket = to_dev(bucket_h)
        flag, want = cp.zeros(1, np.int32), np.zeros(1, np.int32)
        K.unpack(devs, bucket, offs, scale=0.75, nonfinite_flag=flag)
        K.unpack_ref(hosts, bucket_h, offs, scale=0.75, nonfinite_flag=want)
        for d, h in zip(devs, hosts):
            eq(to_host(d), h)
        assert int(to_host(flag)[0]) == int(want[0]) == int(bad)
        if pair[0] == pair[1]:
            views = [bucket[o : o + h.size] for o, h in zip(offs, hosts)]
            flag2 = cp.zeros(1, np.int32)
            K.flag_nonfinite(views, bucket, offs, flag2)
            assert int(to_host(flag2)[0]) == int(bad)
            eq(to_host(bucket), bucket_h)  # the check does not write the bucket


@pytest.mark.parametrize("dtype", sorted(K.SCALE_DTYPES))
@pytest.mark.parametrize("start", [0, 1])
def test_scale_and_zero(dtype, start):
    h = np.random.default_rng().uniform(-3, 3, 1_000_003).astype(DT[dtype])
    d = to_dev(h)[start:]
    K.scale_(d, 0.3)
    want = h[start:].copy()
    K.scale_ref(want, 0.3)
    eq(to_host(d), want)
    K.zero_(d)
    assert not to_host(d).astype(np.float64).any()


def test_one_huge_tensor():
    h = np.random.default_rng().standard_normal(50_000_001).astype(np.float32)
    d = to_dev(h)
    bucket = cp.full(h.size + 4, np.nan, cp.float32)
    K.pack([d], bucket, [4], scale=0.5)
    eq(to_host(bucket[4:]), h * np.float32(0.5))
    out = cp.full(h.size, np.nan, cp.float32)
    K.unpack([out], bucket, [4], scale=2.0)
    eq(to_host(out), h)


def test_table_cache_reused_then_rebuilt_when_pointers_change():
    kb = ck.backend()
    rng = np.random.default_rng()
    hosts, devs, offs, total = make_sources(rng, 200, "float32", misalign=True)
    bucket = cp.empty(total, cp.float32)
    K.pack(devs, bucket, offs)
    builds, uploads = kb.stats["table_builds"], kb.stats["table_uploads"]
    for _ in range(3):
        K.pack(devs, bucket, offs)
    assert (kb.stats["table_builds"], kb.stats["table_uploads"]) == (builds, uploads)
    devs = [cp.asarray(h) + 1 for h in hosts]  # new arrays, new pointers, new values
    K.pack(devs, bucket, offs)
    assert kb.stats["table_builds"] == builds + 1 and kb.stats["table_uploads"] == uploads + 1
    want = np.zeros(total, np.float32)
    K.pack_ref([h + np.float32(1) for h in hosts], want, offs)
    got = to_host(bucket)
    for o, h in zip(offs, hosts):
        eq(got[o : o + h.size], want[o : o + h.size])


def test_stream_ordering_through_events_without_host_sync():
    from nccl_ddp.device import get_device

    dev = get_device("cuda")
    producer, consumer = dev.new_stream(), dev.new_stream()
    n = 1 << 22
    srcs = [cp.zeros(n, cp.float32) for _ in range(40)]
    scratch = cp.ones(1 << 26, cp.float32)
    bucket = cp.full(40 * n, np.nan, cp.float32)
    cp.cuda.Device().synchronize()

    def produce():
        for _ in range(20):  # keep the producer busy for a while
            cp.multiply(scratch, 1.0000001, out=scratch)
        for i, s in enumerate(srcs):
            s.fill(i + 1)

    producer.submit(produce)
    ready = producer.record()
    consumer.wait(ready)  # no host block
    consumer.submit(K.pack, srcs, bucket, [i * n for i in range(40)], scale=2.0)
    done = consumer.record()
    done.synchronize(timeout=60)
    assert ready.query()
    got = to_host(bucket).reshape(40, n)
    assert (got == (2.0 * np.arange(1, 41, dtype=np.float32))[:, None]).all()


def test_module_compiles_without_warnings_and_bf16_arrays_work():
    src = (K.kernel_source_dir() / "bucket.cu").read_text()
    mod = cp.RawModule(code=src, options=ck.COMPILE_OPTIONS, name_expressions=tuple(ck.name_expressions()))
    log = io.StringIO()
    mod.compile(log_stream=log)
    assert log.getvalue().strip() == ""
    for name in ck.name_expressions():
        mod.get_function(name)
    b = cp.empty(10, BF16)
    assert K.dtype_name(b) == "bfloat16" and b.nbytes == 20


def test_occupancy_query_and_one_wave_chunk():
    kb = ck.backend()
    dev = cp.cuda.Device().id
    name = ck.kernel_name("pack", ("float32", "float32"), False, True)
    fn = kb.function(dev, name)
    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, ck.THREADS, 0)
    assert per_sm >= 2
    warps = kb.resident_warps(dev, name)
    assert warps == per_sm * kb._sms(dev) * ck.WARPS_PER_BLOCK
    sizes = np.array([25 * 2**20 // 4], np.int64)
    chunk = ck.choose_chunk(sizes, ("float32", "float32"), warps)
    assert 0.97 * warps < -(-sizes[0] // chunk) <= warps


def test_float32_subnormals_survive_cupys_ftz_on_the_gpu():
    """CuPy compiles with -ftz=true: pack/unpack/scale keep float32 subnormals bit for bit."""
    x = np.array([2.0**-149 * 3, -1e-40, 1e-39, 2.0**-127, 1e-30, -0.0] * 50, np.float32)
    for bdt in (np.dtype(np.float32), BF16):
        bucket = cp.empty(x.size, dtype=bdt)
        poison(bucket)
        K.pack([to_dev(x)], bucket, [0], scale=0.5)
        want = np.empty(x.size, bdt)
        K.pack_ref([x], want, [0], scale=0.5)
        np.testing.assert_array_equal(
            to_host(bucket).view(np.uint16 if bdt == BF16 else np.uint32),
            want.view(np.uint16 if bdt == BF16 else np.uint32),
        )
    out = to_dev(np.full(x.size, 1e-39, np.float32))
    K.unpack([out], to_dev(x), [0], scale=0.25, accumulate=True)
    ref = np.full(x.size, 1e-39, np.float32)
    K.unpack_ref([ref], x, [0], scale=0.25, accumulate=True)
    np.testing.assert_array_equal(to_host(out).view(np.uint32), ref.view(np.uint32))


def test_torch_bfloat16_cuda_tensors_pack_and_unpack():
    """A bf16 CUDA tensor through the torch adapter (CuPy reads DLPack bf16 as ml_dtypes)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    from nccl_ddp.adapters.torch import tensors as torch_adapter

    t = torch.randn(1001, device="cuda").to(torch.bfloat16)
    native = torch_adapter.to_native(t)
    assert native.dtype == BF16 and native.data.ptr == t.data_ptr()
    bucket = cp.empty(1003, dtype=BF16)
    poison(bucket)
    K.pack([native], bucket, [2], scale=0.5)
    host = t.view(torch.int16).cpu().numpy().view(BF16)
    want = np.full(1003, np.nan, BF16)
    K.pack_ref([host], want, [2], scale=0.5)
    eq(to_host(bucket)[2:], want[2:])
    K.unpack([native], bucket, [2], scale=2.0, accumulate=True)
    torch.cuda.synchronize()
    ref = host.copy()
    K.unpack_ref([ref], want, [2], scale=2.0, accumulate=True)
    eq(t.view(torch.int16).cpu().numpy().view(BF16), ref)
    assert torch_adapter.from_native(native).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# fused optimizer steps (kernels/optim.cu)


def _optim_case(rng, op, gt, pt, n, offset):
    """Host arrays (full-range values, subnormals, -0.0, NaN/Inf grads) and device views that
    start `offset` elements past a 256-byte boundary (a shard cut anywhere in a bucket)."""
    from kernel_cases import values

    host = {"master": values(rng, n, "float32"), "grad": values(rng, n, gt, nonfinite=True)}
    for name in ("a",) if op == "sgd" else ("a", "b", "c"):
        x = values(rng, n, "float32")
        x[~np.isfinite(x)] = 1.0
        host[name] = x if name == "a" else np.abs(x)
    host["out"] = np.full(n, np.nan, DT[pt])
    dev = {}
    for k, h in host.items():
        base = cp.empty(n + offset + 8, dtype=h.dtype)
        view = base[offset : offset + n]
        view.set(h)
        dev[k] = view
    poison(dev["out"])
    return host, dev


@pytest.mark.parametrize("op", ["sgd", "adamw"])
@pytest.mark.parametrize("gt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("pt", ["float32", "bfloat16", "float16"])
def test_fused_optimizer_step_matches_reference(op, gt, pt):
    rng = np.random.default_rng()
    for n, offset in ((1, 0), (4099, 1), (4099, 0), ((1 << 20) + 3, 3), (5_000_000, 2)):
        host, dev = _optim_case(rng, op, gt, pt, n, offset)
        for a in (dev, host):
            if op == "sgd":
                K.sgd_step(
                    a["master"],
                    a["grad"],
                    a["a"],
                    a["out"],
                    lr=0.1,
                    momentum=0.9,
                    nesterov=True,
                    weight_decay=1e-2,
                    grad_scale=0.5,
                )
            else:
                K.adamw_step(
                    a["master"],
                    a["grad"],
                    a["a"],
                    a["b"],
                    a["c"],
                    a["out"],
                    step=5,
                    lr=1e-3,
                    weight_decay=0.1,
                    amsgrad=True,
                    grad_scale=1 / 3,
                )
        cp.cuda.Device().synchronize()
        for k, h in host.items():
            eq(to_host(dev[k]), h)


def test_shard_adamw_on_cupy_equals_numpy_over_steps():
    import nccl_ddp as nd

    rng = np.random.default_rng()
    n = 3_000_001
    m_h = rng.standard_normal(n).astype(np.float32)
    m_d = cp.asarray(m_h)
    out_d = cp.empty(n, dtype=BF16)
    out_h = np.empty(n, BF16)
    opt = nd.ShardAdamW(lr=1e-3, weight_decay=0.1)
    s_h, s_d = opt.init_state(m_h), opt.init_state(m_d)
    for _ in range(3):
        g = rng.standard_normal(n).astype(BF16)
        opt.step(m_d, cp.asarray(g), s_d, params_out=out_d, grad_scale=0.5)
        opt.step(m_h, g, s_h, params_out=out_h, grad_scale=0.5)
    eq(to_host(m_d), m_h)
    eq(to_host(out_d), out_h)
    for name, b in s_h.buffers.items():
        eq(to_host(s_d.buffers[name]), b)
