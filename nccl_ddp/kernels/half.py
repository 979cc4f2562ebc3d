"""float32 -> float16 in NumPy at several times the speed of NumPy's own cast (a scalar loop
per element: `astype(np.float16)`), with its bits: round to nearest even, NaNs as NumPy makes
them. The pack of the fp16 compression (`spec.pack_ref`) runs it a piece at a time, so the
rounding, widening and scaling of a piece stay in the cache.

Normal results come from integer arithmetic on the float32 bits (the exponent rebiased, the 13
dropped bits rounded to even by adding 0xFFF plus the lowest kept bit); the few values outside
half's normal range (below 2**-14: subnormals and zeros, from 65536 on: inf and NaN) are picked
out by one comparison and done apart (subnormals by a float addition that rounds at half's
subnormal step, NaNs by NumPy's cast itself).
"""

from __future__ import annotations

import threading

import numpy as np

PIECE = 1 << 16  # elements per piece: its float32 and scratch arrays fit in L2
_ABS = np.uint32(0x7FFFFFFF)
_TINY = 113 << 23  # 2**-14 as float32 bits: half's smallest normal
_BIG = 143 << 23  # 65536.0 as float32 bits: from here on, inf or NaN in half
_REBIAS = np.uint32(((15 - 127) << 23) + 0xFFF + (1 << 32))  # 127 -> 15 exponent, round half down
_HALF_STEP = 0x3F000000  # 0.5 as float32 bits: 0.5 + x rounds x at 2**-24, half's subnormal step


class Narrower:
    """Casts float32 to float16 with NumPy's bits; holds its scratch arrays (one piece each),
    so one instance per thread."""

    def __init__(self) -> None:
        self._t = np.empty(PIECE, np.uint32)
        self._a = np.empty(PIECE, np.uint32)
        self._w = np.empty(PIECE, np.uint32)
        self._m = np.empty(PIECE, bool)

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst (float16, contiguous, at most PIECE elements) = src (float32) rounded."""
        k = src.size
        x = src.reshape(-1).view(np.uint32)
        t, a, m = self._t[:k], self._a[:k], self._m[:k]
        np.bitwise_and(x, _ABS, out=a)
        np.right_shift(a, 13, out=t)
        np.bitwise_and(t, 1, out=t)  # the lowest kept bit: ties go to even
        np.add(t, a, out=t)
        np.add(t, _REBIAS, out=t)
        np.right_shift(t, 13, out=t)
        np.less(a, np.uint32(_TINY), out=m)  # subnormal or zero in half
        if m.any():
            w = self._w[:k]
            np.add(a.view(np.float32), np.float32(0.5), out=w.view(np.float32))
            np.subtract(w, np.uint32(_HALF_STEP), out=w)
            np.copyto(t, w, where=m)
        np.greater_equal(a, np.uint32(_BIG), out=m)  # inf or NaN in half
        if m.any():
            idx = np.flatnonzero(m)
            t[idx] = _inf_nan(x[idx])
        np.bitwise_xor(x, a, out=a)  # the sign bit alone (a still holds |x|'s bits)
        np.right_shift(a, 16, out=a)
        np.bitwise_or(t, a, out=t)
        np.copyto(dst.reshape(-1).view(np.uint16), t, casting="unsafe")  # the low 16 bits


def _inf_nan(x: np.ndarray) -> np.ndarray:
    """Half bits (no sign) of float32 bits `x` from 65536 on: inf, or NaN as NumPy casts it."""
    a = x & _ABS
    out = np.full(x.size, 0x7C00, np.uint32)
    nan = a > 0x7F800000
    if nan.any():
        out[nan] = x[nan].view(np.float32).astype(np.float16).view(np.uint16) & 0x7FFF
    return out


_local = threading.local()


def narrower() -> Narrower:
    """This thread's `Narrower` (host streams run kernels on threads of their own)."""
    nar: Narrower | None = getattr(_local, "narrower", None)
    if nar is None:
        nar = _local.narrower = Narrower()
    return nar


def pack_scaled(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """dst (float16) = half(float32(half(src)) * scale), `spec.pack_ref`'s bits for a float32
    grad into a float16 bucket (torch's compress hook's order: round, then scale), a piece at
    a time."""
    nar = narrower()
    y, x = dst.reshape(-1), src.reshape(-1)
    wide = np.empty(min(PIECE, x.size), np.float32)
    for o in range(0, x.size, PIECE):
        yo = y[o : o + PIECE]
        w = wide[: yo.size]
        nar(yo, x[o : o + PIECE])
        np.copyto(w, yo)  # widening is exact
        np.multiply(w, scale, out=w)
        nar(yo, w)


def unpack_scaled(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """dst (float32) = float32(src) * scale for a float16 bucket, a piece at a time (no
    temporaries the size of the bucket)."""
    y, x = dst.reshape(-1), src.reshape(-1)
    for o in range(0, x.size, PIECE):
        yo = y[o : o + PIECE]
        np.copyto(yo, x[o : o + PIECE])
        np.multiply(yo, scale, out=yo)
