"""float32 values rounded to float16's values and kept in float32 (the bits of
`astype(float16).astype(float32)`), by two float additions a piece: what the host backend's fp16
compression on float32 buffers computes (`comm/host/reduce.py`), with no half bits and no widening.

y + m, where m is y's sign times 2**(e + 13) and e is y's exponent (at least -14, half's
smallest normal), keeps 10 bits of y below its leading one (the subnormal step 2**-24 below
2**-14), rounded to nearest even by the addition itself; subtracting m again is exact. From
2**15 on (inf, NaN, overflow to inf) NumPy's casts do the few values there are.
"""

from __future__ import annotations

import numpy as np

from nccl_ddp.kernels.half import PIECE, per_thread

_SIGN = np.uint32(0x80000000)
_EXP = np.uint32(0x7F800000)
_MIN_E = 113 << 23  # 2**-14's exponent bits: below it, half's step stays 2**-24
_MAGIC = np.uint32(13 << 23)  # 2**13 times y's power of two: its ulp is half's step at y
_BIG_E = np.uint32(142 << 23)  # 2**15: from here on NumPy's casts (inf, NaN, 65520 -> inf)


class Rounder:
    """Rounds float32 to float16's grid in place or into another float32 array; holds its
    scratch arrays (one piece each), so one instance per thread."""

    def __init__(self) -> None:
        self._s = np.empty(PIECE, np.uint32)
        self._e = np.empty(PIECE, np.uint32)
        self._m = np.empty(PIECE, bool)
        self._min = np.full(PIECE, _MIN_E, np.uint32)  # (max with a scalar is a scalar loop)

    def __call__(self, out: np.ndarray, y: np.ndarray, signed: bool = True) -> None:
        """out (float32, contiguous, at most PIECE elements; `y` itself allowed) = y's float16
        value (NumPy's cast, widened). `signed` False: a zero result may lack y's sign, which
        stays here for `to_step(signs_kept=True)` (a quantize's last rounding) to put back."""
        k = y.size
        yf = y.reshape(-1)
        yb, ob = yf.view(np.uint32), out.reshape(-1).view(np.uint32)
        s, e, m = self._s[:k], self._e[:k], self._m[:k]
        np.bitwise_and(yb, _SIGN, out=s)
        np.bitwise_and(yb, _EXP, out=e)
        big = None
        if k and e.max() >= _BIG_E:  # (one pass; the comparison only where there is one)
            np.greater_equal(e, _BIG_E, out=m)
            big = np.flatnonzero(m)  # before `out` (maybe y) is written:
            kept = yf[big].astype(np.float16).astype(np.float32)
        np.maximum(e, self._min[:k], out=e)
        np.add(e, _MAGIC, out=e)
        np.bitwise_or(e, s, out=e)  # m: y's sign, 2**(e + 13)
        mf = e.view(np.float32)
        of = ob.view(np.float32)
        np.add(yf, mf, out=of)  # the rounding
        np.subtract(of, mf, out=of)  # exact
        if signed:
            np.bitwise_or(ob, s, out=ob)  # a zero keeps y's sign, as the cast keeps it
        if big is not None:
            of[big] = kept

    def to_step(self, v: np.ndarray, signs_kept: bool = False) -> None:
        """v (float32, contiguous, at most PIECE elements, on float16's grid wherever |v| is
        2**-14 or more) rounded in place to half's subnormal step 2**-24 below 2**-14: adding
        and subtracting 0.5 with v's sign is exact on that grid (up to 2**22) and rounds below it.
        `signs_kept`: v's signs are the ones the last call left here (v came from that y)."""
        k = v.size
        vb = v.reshape(-1).view(np.uint32)
        s, e = self._s[:k], self._e[:k]
        if not signs_kept:
            np.bitwise_and(vb, _SIGN, out=s)
        np.bitwise_or(s, _HALF, out=e)
        ef, vf = e.view(np.float32), vb.view(np.float32)
        np.add(vf, ef, out=vf)
        np.subtract(vf, ef, out=vf)
        np.bitwise_or(vb, s, out=vb)


_HALF = np.uint32(0x3F000000)  # 0.5: its ulp is 2**-24


def rounder() -> Rounder:
    """This thread's `Rounder` (host collectives run on threads of their own)."""
    r: Rounder = per_thread("rounder", Rounder)
    return r


def round_values(out: np.ndarray, y: np.ndarray) -> None:
    """out (float32) = y rounded to float16's values, a piece at a time (`out` may be `y`)."""
    r = rounder()
    o, x = out.reshape(-1), y.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, x.size, PIECE):
            r(o[lo : lo + PIECE], x[lo : lo + PIECE])


def quantize(out: np.ndarray, x: np.ndarray, scale: float) -> None:
    """out (float32) = float32(half(float32(half(x)) * scale)): the fp16 compression's pack
    (`spec.pack_ref`, torch's order: round, then scale) widened back, a piece at a time (`out`
    may be `x`)."""
    r, s = rounder(), np.float32(scale)
    m, _ = np.frexp(s)
    # a power of two up to 1 keeps half's grid down to 2**-14: only the subnormal step to round
    pow2 = bool(m == 0.5 and s <= 1)
    o, y = out.reshape(-1), x.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, y.size, PIECE):
            op = o[lo : lo + PIECE]
            r(op, y[lo : lo + PIECE], signed=not pow2)  # (to_step puts x's signs back)
            np.multiply(op, s, out=op)  # (by 1 too: a signaling NaN is quieted, as in the pack)
            if pow2:
                r.to_step(op, signs_kept=True)
            else:
                r(op, op)
