"""Elementwise reductions of the host backend, one `Reduction` per (dtype, op).

float16 / bfloat16 accumulate in float32 while several inputs are combined at once. AVG divides the
sum by the number of ranks; on integer dtypes it truncates toward zero, like NCCL's ncclAvg
(sum, then C integer division). bool supports only MAX (any) and MIN (all).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.kernels import half, half_round
from nccl_ddp.kernels.spec import SCALE_DTYPES, scale_ref

DTYPE_NAMES: tuple = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "bfloat16",
    "uint16",
)
"""Supported dtypes by name; a dtype's index here is its code in wire headers (so new ones go
last). Names, not dtypes: bfloat16 is ml_dtypes' (a 0.6-4 s import), and a job that never sees a
bfloat16 array never loads it."""


def dtypes() -> tuple:
    """The supported dtypes as NumPy dtypes (bfloat16 only where ml_dtypes is installed); this
    imports ml_dtypes, so only tests and diagnostics call it."""
    out = [np.dtype(n) for n in DTYPE_NAMES if n != "bfloat16"]
    try:
        from nccl_ddp.arrays.dlpack import bfloat16_dtype

        out.append(bfloat16_dtype())
    except ConfigError:  # bfloat16 arrays cannot exist without ml_dtypes either
        pass
    return tuple(out)


_HALF = {"float16", "bfloat16"}
_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}
_BOOL_UFUNC = {ReduceOp.MAX: np.logical_or, ReduceOp.MIN: np.logical_and}


def dtype_code(dtype: Any, where: str) -> int:
    """The wire code of `dtype`; `ConfigTypeError` naming `where` (rank, op) if unsupported."""
    dt = np.dtype(dtype)
    try:
        return DTYPE_NAMES.index(dt.name)
    except ValueError:
        raise ConfigTypeError(
            f"{where}: dtype {dt} is not supported by the host backend; use one of {list(DTYPE_NAMES)}"
        ) from None


class Reduction:
    """Combines arrays of one dtype with one op; `world` is the divisor of AVG. `prescale`: every
    rank's input counts multiplied by it first (a SUM of floats only: NCCL's PreMulSum), with the
    bits of `kernels.scale_` on each rank's whole buffer before the reduction."""

    def __init__(self, dtype: Any, op: ReduceOp, world: int, where: str, prescale: float = 1.0) -> None:
        self.dtype = np.dtype(dtype)
        self.op = op
        self.world = world
        self.prescale = prescale
        if prescale != 1.0 and (op is not ReduceOp.SUM or self.dtype.name not in SCALE_DTYPES):
            raise ConfigError(
                f"{where}: a pre-multiplied reduction is a SUM of floats, not {op.value} of {self.dtype}"
            )
        dtype_code(self.dtype, where)
        if self.dtype == np.bool_:
            if op not in _BOOL_UFUNC:
                raise ConfigError(f"{where}: op {op.value} is not defined for bool; use max or min")
            self.ufunc: Any = _BOOL_UFUNC[op]
        else:
            self.ufunc = _UFUNC[op]
        self.half = self.dtype.name in _HALF and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD)
        # the factor as scale_ref multiplies by it, where that is one multiply in the data's dtype
        self._factor = self.dtype.type(prescale) if self.dtype.name in ("float32", "float64") else None

    def combine(self, out: np.ndarray, others: Sequence[np.ndarray], final: bool) -> None:
        """out = out (op) others[0] (op) others[1] ..., in that order; `final`: divide for AVG."""
        if self._fast_half(out):
            half.combine(out, others, self.ufunc, self._divide if final else None)
            return
        if self.half:
            acc = out.astype(np.float32)
            for o in others:
                self.ufunc(acc, o, out=acc)
            if final:
                self._divide(acc)
            np.copyto(out, acc, casting="unsafe")
            return
        for o in others:
            self.ufunc(out, o, out=out)
        if final:
            self._divide(out)

    @property
    def prescales(self) -> bool:
        """Whether each rank's input goes through `scaled` / `scale_all` before it is summed."""
        return self.prescale != 1.0

    def scale_all(self, buf: np.ndarray) -> None:
        """This rank's whole input multiplied by `prescale`, in place (the unfused way)."""
        if self.prescale != 1.0:
            scale_ref(buf, self.prescale)

    def scaled(self, out: np.ndarray, x: np.ndarray) -> np.ndarray:
        """`out` (x's size; x itself allowed) = x * prescale, rounded as `scale_all` rounds it.
        float32/float64: one multiply in x's own precision, scale_ref's, without its per-call
        checks (a fused reduction calls this per 256 KiB piece; the caller ignores overflow)."""
        if self._factor is not None:
            return np.multiply(x, self._factor, out=out)
        if out is not x:
            np.copyto(out, x)
        scale_ref(out, self.prescale)
        return out

    def finish(self, out: np.ndarray) -> None:
        """Apply AVG's division to a fully reduced array (no-op for the other ops)."""
        if self.op is not ReduceOp.AVG:
            return
        if self._fast_half(out):
            half.combine(out, [], self.ufunc, self._divide)
        elif self.half:
            acc = out.astype(np.float32)
            self._divide(acc)
            np.copyto(out, acc, casting="unsafe")
        else:
            self._divide(out)

    def _fast_half(self, out: np.ndarray) -> bool:
        """float16 through kernels.half's casts (NumPy's are scalar loops, slower on subnormals),
        same bits; a strided `out` (none of the collectives hands one) through NumPy's."""
        return self.half and self.dtype == np.float16 and out.flags.c_contiguous

    def _divide(self, a: np.ndarray) -> None:
        if self.op is not ReduceOp.AVG or self.world == 1:
            return
        if a.dtype.kind == "f":
            np.divide(a, self.world, out=a)
        elif a.dtype.kind == "u":
            np.floor_divide(a, self.world, out=a)
        else:  # truncate toward zero, as C integer division does
            q, r = np.divmod(a, self.world)
            q += ((r != 0) & (a < 0)).astype(a.dtype)
            np.copyto(a, q)


class Float16WireSum(Reduction):
    """A SUM of float32 buffers with the bits of the fp16 compression (torch's
    `fp16_compress_hook` as the reducer fuses it: each rank's buffer rounded to float16, scaled
    by `prescale`, rounded again; the float16 sum of those; widened back), computed on the
    float32 values themselves (`kernels.half_round`): no float16 buffer, no casts of NumPy's.
    Partial sums (the TCP ring's hops) are rounded as a float16 wire rounds them."""

    def __init__(self, world: int, where: str, prescale: float) -> None:
        super().__init__(np.float32, ReduceOp.SUM, world, where, prescale)
        self.half = False

    @property
    def prescales(self) -> bool:
        return True

    def scale_all(self, buf: np.ndarray) -> None:
        half_round.quantize(buf, buf, self.prescale)

    def scaled(self, out: np.ndarray, x: np.ndarray) -> np.ndarray:
        half_round.quantize(out, x, self.prescale)
        return out

    def combine(self, out: np.ndarray, others: Sequence[np.ndarray], final: bool) -> None:
        for o in others:
            np.add(out, o, out=out)
        half_round.round_values(out, out)

    def finish(self, out: np.ndarray) -> None:
        return None


def make_reduction(dtype: Any, op: ReduceOp, world: int, where: str, prescale: float, wire: Any) -> Reduction:
    """The reduction of a collective: `wire` "float16": the fp16 compression's (`Float16WireSum`)."""
    if wire is None:
        return Reduction(dtype, op, world, where, prescale)
    return Float16WireSum(world, where, prescale)


def check_compressed(rank: int, group: str, buf: Any, compression: str, transport: str) -> None:
    """A fused compressed all-reduce is float16 of float32 buffers on the shm transport; else a
    clear error, raised before the op (no rank runs it)."""
    if compression != "float16" or transport != "ShmTransport":
        raise ConfigError(
            f"rank {rank}: a fused {compression} all-reduce needs float16 on the shm transport "
            f"(fuses_compression); group {group} runs {transport}"
        )
    dtype = getattr(buf, "dtype", type(buf).__name__)
    if dtype != np.float32:
        raise ConfigTypeError(f"rank {rank}: a float16-compressed sum takes float32 buffers, got {dtype}")
