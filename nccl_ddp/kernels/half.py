"""float16 <-> float32 in NumPy at several times the speed of NumPy's own casts (scalar loops
per element here, slower still on subnormals: `astype`), with their bits: round to nearest even,
NaNs as NumPy makes them. The fp16 pack and unpack (`spec.pack_ref` / `unpack_ref`) and the host
backend's float16 sums (`comm/host/reduce.py`) run them a piece at a time, so a piece's rounding,
widening and scaling stay in the cache.

Narrowing: normal results come from integer arithmetic on the float32 bits (the exponent rebiased,
the 13 dropped bits rounded to even by adding 0xFFF plus the lowest kept bit), subnormal ones from
a float addition that rounds at half's subnormal step, the smaller of the two being the right one
(no branch, no masked copy: NumPy's `copyto(where=)` costs 20 adds); the few values from 65536 on
(inf and NaN) are picked out by one comparison and cast by NumPy itself. Widening is one gather
from a table of all 65536 halves that NumPy's own cast filled in once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

PIECE = 1 << 16  # elements per piece: its float32 and scratch arrays fit in L2
_ABS = np.uint32(0x7FFFFFFF)
_TINY = 113 << 23  # 2**-14 as float32 bits: half's smallest normal
_BIG = 143 << 23  # 65536.0 as float32 bits: from here on, inf or NaN in half
_REBIAS = np.uint32(((15 - 127) << 23) + 0xFFF + (1 << 32))  # 127 -> 15 exponent, round half down
_HALF_STEP = 0x3F000000  # 0.5 as float32 bits: 0.5 + x rounds x at 2**-24, half's subnormal step
_H_INF = 0x7C00  # half's exponent field all ones: inf and NaN


class Narrower:
    """Casts float32 to float16 with NumPy's bits; holds its scratch arrays (one piece each),
    so one instance per thread."""

    def __init__(self) -> None:
        self._t = np.empty(PIECE, np.uint32)
        self._a = np.empty(PIECE, np.uint32)
        self._w = np.empty(PIECE, np.uint32)
        self._s = np.empty(PIECE, np.uint32)
        self._m = np.empty(PIECE, bool)
        # min/max against a scalar is a scalar loop in NumPy (3x an add); against an array, not
        self._tiny = np.full(PIECE, _TINY, np.uint32)
        self._lims: dict = {}

    def _lim(self, halvings: int) -> np.ndarray:
        lim = self._lims.get(halvings)
        if lim is None:
            lim = self._lims[halvings] = np.full(PIECE, (halvings + 1) << 10, np.uint32)
        return lim

    def __call__(self, dst: np.ndarray, src: np.ndarray, halvings: Optional[int] = None) -> None:
        """dst (float16, contiguous, at most PIECE elements) = src (float32) rounded; with
        `halvings` k (>= 0), that half then multiplied by 2**-k in float32 and rounded again:
        the bits of half(float32(half(src)) * 2**-k), a few passes more, not a second cast."""
        k = src.size
        x = src.reshape(-1).view(np.uint32)
        t, a, w, m = self._t[:k], self._a[:k], self._w[:k], self._m[:k]
        np.bitwise_and(x, _ABS, out=a)
        np.maximum(a, self._tiny[:k], out=w)  # below half's normal range: its smallest normal
        np.right_shift(w, 13, out=t)
        np.bitwise_and(t, 1, out=t)  # the lowest kept bit: ties go to even
        np.add(t, w, out=t)
        np.add(t, _REBIAS, out=t)
        np.right_shift(t, 13, out=t)  # normal results' bits; 0x400 for |x| < 2**-14
        # subnormal results: 0.5 + |x| rounds at half's subnormal step; from 2**-14 on this is
        # at least the normal result (equal in the first binade, which has the same step)
        np.add(a.view(np.float32), np.float32(0.5), out=w.view(np.float32))
        np.subtract(w, np.uint32(_HALF_STEP), out=w)
        np.minimum(t, w, out=t)
        np.greater_equal(a, np.uint32(_BIG), out=m)  # inf or NaN in half
        if m.any():
            idx = np.flatnonzero(m)
            t[idx] = _inf_nan(x[idx])
        if halvings is not None:
            self._halve(t, halvings)
        np.bitwise_xor(x, a, out=a)  # the sign bit alone (a still holds |x|'s bits)
        np.right_shift(a, 16, out=a)
        np.bitwise_or(t, a, out=t)
        np.copyto(dst.reshape(-1).view(np.uint16), t, casting="unsafe")  # the low 16 bits

    def _halve(self, t: np.ndarray, halvings: int) -> None:
        """Half magnitudes `t` (bits, no sign) times 2**-halvings, rounded again: a smaller
        exponent where the result stays normal, a rounding at half's subnormal step where it
        does not (the larger of the two is the right one), inf and NaN as they are."""
        k = t.size
        m, w = self._m[:k], self._w[:k]
        big = None
        np.greater_equal(t, np.uint32(_H_INF), out=m)
        if m.any():
            big = np.flatnonzero(m)
            kept = t[big]
            kept[kept > _H_INF] |= np.uint32(0x200)  # a float multiply quiets a signaling NaN
        if halvings:
            s = self._s[:k]
            # from (k + 1) << 10 on the scaled result is normal
            np.minimum(
                t, self._lim(halvings)[:k], out=s
            )  # what is scaled to 2**-14 or more gives 0x400 below
            if halvings == 1:  # up to 0x800 a half's value is its bits times 2**-24: halve them
                np.right_shift(s, 1, out=w)
                np.bitwise_and(w, 1, out=w)  # ties to even
                np.add(w, s, out=w)
                np.right_shift(w, 1, out=w)
            else:
                wide = w.view(np.float32)
                widen(wide, s)  # exact
                np.multiply(wide, np.float32(2.0**-halvings), out=wide)  # exact, float32-normal
                np.add(wide, np.float32(0.5), out=wide)  # rounds at 2**-24, ties to even
                np.subtract(w, np.uint32(_HALF_STEP), out=w)
            np.subtract(t, np.uint32(halvings << 10), out=t)  # negative (int32) below 2**-14
            np.maximum(t.view(np.int32), w.view(np.int32), out=t.view(np.int32))
        if big is not None:
            t[big] = kept


def _inf_nan(x: np.ndarray) -> np.ndarray:
    """Half bits (no sign) of float32 bits `x` from 65536 on: inf, or NaN as NumPy casts it."""
    a = x & _ABS
    out = np.full(x.size, 0x7C00, np.uint32)
    nan = a > 0x7F800000
    if nan.any():
        out[nan] = x[nan].view(np.float32).astype(np.float16).view(np.uint16) & 0x7FFF
    return out


_local = threading.local()


def per_thread(name: str, make: Callable[[], Any]) -> Any:
    """This thread's instance of a kernel's scratch holder `name` (host streams and collectives
    run on threads of their own), made by `make()` the first time."""
    obj = getattr(_local, name, None)
    if obj is None:
        obj = make()
        setattr(_local, name, obj)
    return obj


def narrower() -> Narrower:
    """This thread's `Narrower`."""
    nar: Narrower = per_thread("narrower", Narrower)
    return nar


_WIDE: Optional[np.ndarray] = None  # float32 bits of every half, from NumPy's cast


def _wide_table() -> np.ndarray:
    global _WIDE
    if _WIDE is None:
        every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
        _WIDE = every.astype(np.float32).view(np.uint32)
    return _WIDE


def widen(dst: np.ndarray, src: np.ndarray) -> None:
    """dst (float32, contiguous) = src widened, NumPy's bits: `src` a float16 array, or half
    bits in an unsigned array (below 2**16), of dst's size."""
    bits = src.reshape(-1)
    if bits.dtype == np.float16:
        bits = bits.view(np.uint16)
    np.take(_wide_table(), bits, out=dst.reshape(-1).view(np.uint32), mode="clip")


def power_of_two(scale: np.float32) -> int:
    """k where scale == 2**-k (0 < k < 64), else 0: a scale the narrowing can fold in."""
    m, e = np.frexp(np.float64(scale))
    return int(1 - e) if m == 0.5 and 0 < 1 - e < 64 else 0


def pack_scaled(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """dst (float16) = half(float32(half(src)) * scale), `spec.pack_ref`'s bits for a float32
    grad into a float16 bucket (torch's compress hook's order: round, then scale), a piece at
    a time; a scale of 2**-k (a world of 2, 4, 8...) folded into the one narrowing."""
    nar = narrower()
    y, x = dst.reshape(-1), src.reshape(-1)
    k = 0 if scale == 1 else power_of_two(scale)
    if k or scale == 1:
        for o in range(0, x.size, PIECE):
            nar(y[o : o + PIECE], x[o : o + PIECE], k)
        return
    wide = np.empty(min(PIECE, x.size), np.float32)
    for o in range(0, x.size, PIECE):
        yo = y[o : o + PIECE]
        w = wide[: yo.size]
        nar(yo, x[o : o + PIECE])
        widen(w, yo)
        np.multiply(w, scale, out=w)
        nar(yo, w)


def unpack_scaled(dst: np.ndarray, src: np.ndarray, scale: np.float32) -> None:
    """dst (float32) = float32(src) * scale for a float16 bucket, a piece at a time (no
    temporaries the size of the bucket)."""
    y, x = dst.reshape(-1), src.reshape(-1)
    for o in range(0, x.size, PIECE):
        yo = y[o : o + PIECE]
        widen(yo, x[o : o + PIECE])
        if scale != 1:
            np.multiply(yo, scale, out=yo)


def _wide_scratch() -> tuple:
    """This thread's two float32 pieces for `combine`."""
    pair: tuple = per_thread("wide", lambda: (np.empty(PIECE, np.float32), np.empty(PIECE, np.float32)))
    return pair


def combine(
    out: np.ndarray, others: Sequence[np.ndarray], ufunc: Any, finish: Optional[Callable[[np.ndarray], None]]
) -> None:
    """out (float16) = ufunc(... ufunc(out, others[0]) ..., others[-1]) in float32, then
    `finish` (AVG's division) and one rounding: the bits of widening with astype and narrowing
    with copyto (the host backend's float16 sums), a piece at a time."""
    nar, (acc, tmp) = narrower(), _wide_scratch()
    y = out.reshape(-1)
    xs = [o.reshape(-1) for o in others]
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, y.size, PIECE):
            hi = min(y.size, lo + PIECE)
            a, w = acc[: hi - lo], tmp[: hi - lo]
            widen(a, y[lo:hi])
            for x in xs:
                widen(w, x[lo:hi])
                ufunc(a, w, out=a)
            if finish is not None:
                finish(a)
            nar(y[lo:hi], a)
