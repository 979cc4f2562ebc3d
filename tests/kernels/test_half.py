"""kernels/half.py: float32 <-> float16 with NumPy's own bits (round to nearest even, NaNs as
NumPy makes them), the fp16 pack/unpack built on them equal to the reference's formula (a 2**-k
scale folded into the narrowing included), and the host backend's float16 sums equal to NumPy's
widen / combine in float32 / round once."""

import numpy as np
import pytest

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.kernels import half
from nccl_ddp.kernels.spec import pack_ref, unpack_ref

EDGES = [
    0,
    0x80000000,
    1,
    0x80000001,
    0x007FFFFF,  # zeros, float32 subnormals
    0x33000000,
    0x33000001,
    0x32FFFFFF,
    0x33800000,
    0x337FFFFF,  # around half's smallest subnormal
    0x387FC000,
    0x387FE000,
    0x387FFFFF,
    0x38800000,
    0x38801000,
    0x38803000,  # subnormal/normal
    0x3F800000,
    0x3F801000,
    0x3F803000,
    0x3F801001,
    0x3F802FFF,  # ties to even, both ways
    0x477FE000,
    0x477FEFFF,
    0x477FF000,
    0x47800000,
    0x4F000000,  # 65504, rounding to inf
    0x7F800000,
    0xFF800000,
    0x7F800001,
    0x7FC00000,
    0xFFC01234,
    0x7FBFFFFF,
    0x7F802000,  # inf, NaN
]


def bits16(a):
    return a.view(np.uint16)


def narrowed(x):
    out = np.empty(x.size, np.float16)
    for o in range(0, x.size, half.PIECE):
        half.narrower()(out[o : o + half.PIECE], x[o : o + half.PIECE])
    return out


def test_edges_as_numpy():
    x = np.array(EDGES, np.uint32)
    x = np.concatenate([x, x | 0x80000000]).view(np.float32)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(bits16(narrowed(x)), bits16(x.astype(np.float16)))


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 1e3])
def test_random_bits_as_numpy(scale):
    """Normal, subnormal and overflowing halves, over several pieces and a partial last one."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(3 * half.PIECE + 5) * scale).astype(np.float32)
    u = rng.integers(0, 1 << 32, x.size // 4, dtype=np.uint64).astype(np.uint32)
    x[: 4 * u.size : 4] = u.view(np.float32)  # any bit pattern, NaN payloads included
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(bits16(narrowed(x)), bits16(x.astype(np.float16)))


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.25, 2.0**-5, 1 / 3, 3.0])
def test_pack_unpack_fp16_formula(scale):
    """pack: half(float32(half(x)) * s); unpack: float32(h) * s: the bits of the reference's
    formula written out with NumPy's casts."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(2 * half.PIECE + 3) * 1e-3).astype(np.float32)
    x[[1, 5, 9]] = [np.nan, 7e4, -np.inf]
    s = np.float32(scale)
    with np.errstate(all="ignore"):
        h = np.empty(x.size, np.float16)
        pack_ref([x], h, [0], scale=scale)
        want = (x.astype(np.float16).astype(np.float32) * s).astype(np.float16)
        np.testing.assert_array_equal(bits16(h), bits16(want))
        w = np.empty(x.size, np.float32)
        unpack_ref([w], h, [0], scale=scale)
        np.testing.assert_array_equal(w.view(np.uint32), (h.astype(np.float32) * s).view(np.uint32))


EVERY_HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def test_widen_every_half_as_numpy():
    """Zeros, subnormals, normals, infs, every NaN payload (signaling ones too)."""
    w = np.empty(EVERY_HALF.size, np.float32)
    half.widen(w, EVERY_HALF)
    np.testing.assert_array_equal(w.view(np.uint32), EVERY_HALF.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 11])
def test_power_of_two_scale_every_half_and_random_bits(k):
    """A 2**-k scale folded into the narrowing: half(float32(half(x)) * 2**-k) for x every half
    (exact in float32: the second rounding alone, subnormal results, ties and the smallest
    normal included) and random float32 bit patterns (NaN payloads, signaling ones quieted by
    the float multiply as NumPy's formula quiets them)."""
    rng = np.random.default_rng(k)
    with np.errstate(all="ignore"):
        exact = EVERY_HALF.astype(np.float32)
        u = rng.integers(0, 1 << 32, 2 * half.PIECE, dtype=np.uint64).astype(np.uint32)
        near = (rng.standard_normal(half.PIECE) * 2.0 ** rng.integers(-26, -10, half.PIECE)).astype(
            np.float32
        )
        x = np.concatenate([exact, u.view(np.float32), near])
        got = np.empty(x.size, np.float16)
        pack_ref([x], got, [0], scale=2.0**-k)
        want = (x.astype(np.float16).astype(np.float32) * np.float32(2.0**-k)).astype(np.float16)
    np.testing.assert_array_equal(bits16(got), bits16(want))


def _numpy_combine(out, others, ufunc, world, avg):
    acc = out.astype(np.float32)
    for o in others:
        ufunc(acc, o, out=acc)
    if avg:
        acc /= np.float32(world)
    return acc.astype(np.float16)


@pytest.mark.parametrize(
    "op,peers",
    [(ReduceOp.SUM, 1), (ReduceOp.SUM, 2), (ReduceOp.AVG, 2), (ReduceOp.PROD, 1), (ReduceOp.MAX, 1)],
)
def test_float16_reduction_as_numpy(op, peers):
    """`Reduction.combine` / `finish` on float16: every half against random halves, and pairs
    built to hit ties of the final rounding, overflow to inf (65504 + 65504), inf - inf (NaN),
    NaN payloads and subnormal sums; the bits of NumPy's widen, float32 ops, one cast."""
    rng = np.random.default_rng(peers)
    n = EVERY_HALF.size
    out = EVERY_HALF.copy()
    others = [
        rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16).view(np.float16) for _ in range(peers)
    ]
    edges = np.array(
        [0x7BFF, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x1400, 0x7E01], np.uint16
    )
    out[: edges.size] = edges.view(np.float16)
    for o in others:
        o[: edges.size] = edges[::-1].view(np.float16)
    ties = rng.integers(0x0400, 0x7800, 4096, dtype=np.uint32).astype(np.uint16)
    out[-4096:] = ties.view(np.float16)
    others[0][-4096:] = (ties.view(np.float16).astype(np.float32) * np.float32(2.0**-11)).astype(np.float16)
    world = peers + 1
    red = Reduction(np.float16, op, world, "test")
    with np.errstate(all="ignore"):
        want = _numpy_combine(out, others, red.ufunc, world, op is ReduceOp.AVG)
        got = out.copy()
        red.combine(got, others, True)
        np.testing.assert_array_equal(bits16(got), bits16(want))
        if op is ReduceOp.AVG:  # the division alone, as the TCP ring's last step does it
            got = out.copy()
            red.finish(got)
            want = (out.astype(np.float32) / np.float32(world)).astype(np.float16)
            np.testing.assert_array_equal(bits16(got), bits16(want))
