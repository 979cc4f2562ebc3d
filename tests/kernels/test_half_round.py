"""kernels/half_round.py: float32 values rounded to float16's values in float32 by float
additions, equal to NumPy's `astype(float16).astype(float32)` bit for bit (ties to even, the
subnormal step, overflow to inf from 65520, inf, NaN payloads, signed zeros), and the fp16 pack
on float32 values (`quantize`) equal to the reference's formula."""

import numpy as np
import pytest

from nccl_ddp.kernels import half_round
from nccl_ddp.kernels.half import PIECE

EVERY_HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def _inputs(seed):
    """Every half, the points halfway between neighbouring halves (ties both ways), random bit
    patterns (NaN payloads, float32 subnormals) and normal values of every magnitude."""
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):
        h = EVERY_HALF[(EVERY_HALF.view(np.uint16) & 0x7FFF) < 0x7BFF]
        up = np.nextafter(h, np.float16(np.inf) * np.where(h.view(np.uint16) >> 15, -1, 1).astype(np.float16))
        ties = ((h.astype(np.float64) + up.astype(np.float64)) / 2).astype(np.float32)
        bits = rng.integers(0, 1 << 32, 2 * PIECE + 3, dtype=np.uint64).astype(np.uint32).view(np.float32)
        mags = (rng.standard_normal(PIECE) * 10.0 ** rng.integers(-10, 6, PIECE)).astype(np.float32)
        edges = np.array(
            [65504, 65519.99, 65520, -65520, 2.0**-24, 2.0**-25, 3 * 2.0**-26, -0.0, 0.0], np.float32
        )
        return np.concatenate([EVERY_HALF.astype(np.float32), ties, bits, mags, edges])


def _bits(a):
    return a.view(np.uint32)


def test_round_values_as_numpy():
    x = _inputs(1)
    out = np.empty_like(x)
    half_round.round_values(out, x)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    half_round.round_values(x, x)  # in place
    np.testing.assert_array_equal(_bits(x), _bits(want))


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.25, 1 / 3, 2.0**-7])
def test_quantize_is_the_fp16_pack_widened(scale):
    """half(float32(half(x)) * scale) widened: the multiply by 1 included (it quiets a
    signaling NaN, as the pack's formula does)."""
    x = _inputs(2)
    out = np.empty_like(x)
    half_round.quantize(out, x, scale)
    with np.errstate(all="ignore"):
        want = (
            (x.astype(np.float16).astype(np.float32) * np.float32(scale))
            .astype(np.float16)
            .astype(np.float32)
        )
    np.testing.assert_array_equal(_bits(out), _bits(want))
