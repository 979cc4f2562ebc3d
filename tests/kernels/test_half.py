"""kernels/half.py: float32 -> float16 with NumPy's own bits (round to nearest even, NaNs as
NumPy makes them), and the fp16 pack/unpack built on it equal to the reference's formula."""

import numpy as np
import pytest

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


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
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
