"""The fused optimizer kernels' specification: the float32 scalars of a step, the checks every call
passes, and the NumPy references that define the results bit for bit (the host path runs these;
kernels/optim.cu must equal them on the GPU).

Arithmetic is torch.optim's single-tensor CPU path, operation by operation, in float32 with one
rounding each: `fma` where torch's CPU kernels use a fused multiply-add (add with alpha, lerp,
addcmul), a separate multiply and add where they do not (addcdiv, the decoupled decay). Against
torch on float32 the states are bitwise equal; the parameters differ only where torch's CPU sqrt
(MKL's vector sqrt, not IEEE-rounded) is one ulp off, which our IEEE sqrt (the GPU's sqrt.rn) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp.errors import KernelError
from nccl_ddp.kernels.spec import _kind, dtype_name

GRAD_DTYPES = frozenset(("float32", "bfloat16", "float16"))
PARAM_DTYPES = frozenset(("float32", "bfloat16", "float16"))

# flag bits, as kernels/optim.cu's enum
SGD_WEIGHT_DECAY, SGD_MOMENTUM, SGD_FRESH_BUFFER, SGD_NESTEROV = 1, 2, 4, 8
ADAM_LERP_FROM_END, ADAM_AMSGRAD = 1, 2

f32 = np.float32


@dataclass(frozen=True)
class SgdScalars:
    """The float32 scalars of one SGD launch (torch casts each Python float to float32)."""

    scale: np.float32
    weight_decay: np.float32
    momentum: np.float32
    one_minus_dampening: np.float32
    neg_lr: np.float32
    flags: int


@dataclass(frozen=True)
class AdamWScalars:
    """The float32 scalars of one AdamW launch; the bias corrections are computed in Python
    floats (double) first, as torch does, then rounded once."""

    scale: np.float32
    decay: np.float32
    lerp_coef: np.float32
    beta2: np.float32
    one_minus_beta2: np.float32
    bias_correction2_sqrt: np.float32
    eps: np.float32
    neg_step: np.float32
    flags: int


def sgd_scalars(
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    fresh_buffer: bool,
    grad_scale: float,
) -> SgdScalars:
    flags = SGD_WEIGHT_DECAY if weight_decay != 0 else 0
    if momentum != 0:
        flags |= SGD_MOMENTUM | (SGD_FRESH_BUFFER if fresh_buffer else 0)
        flags |= SGD_NESTEROV if nesterov else 0
    return SgdScalars(f32(grad_scale), f32(weight_decay), f32(momentum), f32(1 - dampening), f32(-lr), flags)


def adamw_scalars(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    grad_scale: float,
) -> AdamWScalars:
    """`step` counts this step (1 on the first), like torch's state['step'] after its += 1."""
    if step < 1:
        raise KernelError(f"adamw: step must be >= 1 (the step being taken), got {step}")
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    weight = f32(1 - beta1)
    small = abs(weight) < f32(0.5)  # torch's is_lerp_weight_small, in the weight's float32
    flags = (0 if small else ADAM_LERP_FROM_END) | (ADAM_AMSGRAD if amsgrad else 0)
    return AdamWScalars(
        scale=f32(grad_scale),
        decay=f32(1 - lr * weight_decay),
        lerp_coef=weight if small else f32(weight - f32(1)),
        beta2=f32(beta2),
        one_minus_beta2=f32(1 - beta2),
        bias_correction2_sqrt=f32(bias_correction2**0.5),
        eps=f32(eps),
        neg_step=f32(-step_size),
        flags=flags,
    )


# ---------------------------------------------------------------------------------------------
# validation shared by both paths


def check_shard(op: str, master: Any, grad: Any, states: Sequence[tuple], params_out: Any) -> None:
    """One fused step's arrays: `master` float32 and contiguous, `grad` float32/bfloat16/float16,
    `states` (name, array) float32, `params_out` float32/bfloat16/float16 or None; all the same
    size and on the same device; on a GPU aligned to their element size and not overlapping (the
    grad is read through the read-only cache while the others are written). Raises KernelError
    naming the op and the argument."""
    arrays = [("master", master), ("grad", grad), *states]
    if params_out is not None:
        arrays.append(("params_out", params_out))
    kind = _kind(master)
    for name, a in arrays:
        if _kind(a) != kind:
            raise KernelError(
                f"{op}: {name} is a {type(a).__module__}.{type(a).__name__} but "
                f"master is a {kind} array; put every array on the same device"
            )
        if not a.flags.c_contiguous:
            raise KernelError(
                f"{op}: {name} (shape {a.shape}) is not contiguous; pass a contiguous flat shard"
            )
        if a.size != master.size:
            raise KernelError(
                f"{op}: {name} has {a.size} elements but master has {master.size}; "
                "every array of a shard step covers the same elements"
            )
    for name, a in [("master", master), *states]:
        if dtype_name(a) != "float32":
            raise KernelError(
                f"{op}: {name} is {dtype_name(a)}; master weights and optimizer state are float32"
            )
    if dtype_name(grad) not in GRAD_DTYPES:
        raise KernelError(
            f"{op}: grad dtype {dtype_name(grad)} is not supported "
            f"(supported: {', '.join(sorted(GRAD_DTYPES))})"
        )
    if params_out is not None and dtype_name(params_out) not in PARAM_DTYPES:
        raise KernelError(
            f"{op}: params_out dtype {dtype_name(params_out)} is not supported "
            f"(supported: {', '.join(sorted(PARAM_DTYPES))})"
        )
    if kind == "numpy" or master.size == 0:
        return
    # On the GPU: every array aligned to its element size; none overlapping another (a written
    # array shared would race, the grad overlapping a written one breaks the read-only cache).
    for name, a in arrays:
        item = np.dtype(a.dtype).itemsize
        if a.data.ptr % item:
            raise KernelError(
                f"{op}: {name} starts at {a.data.ptr:#x}, not a multiple of its "
                f"{item}-byte element size; pass an aligned copy"
            )
    spans = sorted((a.data.ptr, a.data.ptr + a.nbytes, name) for name, a in arrays)
    for (_, end, n1), (start, _, n2) in zip(spans, spans[1:]):
        if end > start:
            raise KernelError(
                f"{op}: {n1} and {n2} share memory; every array of a shard step "
                "must be distinct (for float32 parameters that are the master "
                "itself, pass params_out=None)"
            )


def sgd_states(sc: SgdScalars, momentum_buf: Optional[Any]) -> list:
    """The (name, array) state one nd_sgd launch reads and writes."""
    if not sc.flags & SGD_MOMENTUM:
        return []
    if momentum_buf is None:
        raise KernelError("sgd: momentum != 0 needs a momentum_buf (float32, the shard's size)")
    return [("momentum_buf", momentum_buf)]


def adamw_states(sc: AdamWScalars, exp_avg: Any, exp_avg_sq: Any, max_exp_avg_sq: Optional[Any]) -> list:
    """The (name, array) state one nd_adamw launch reads and writes."""
    states = [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if sc.flags & ADAM_AMSGRAD:
        if max_exp_avg_sq is None:
            raise KernelError("adamw: amsgrad needs max_exp_avg_sq (float32, the shard's size)")
        states.append(("max_exp_avg_sq", max_exp_avg_sq))
    return states


def check_dispatch(op: str, x: Any) -> None:
    """Every array of one call on one kind of device (the references take NumPy only)."""
    if _kind(x) != "numpy":
        raise KernelError(f"{op}: the reference takes NumPy arrays, got {type(x).__module__}")


# ---------------------------------------------------------------------------------------------
# exact float32 arithmetic in NumPy


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c with ONE rounding (IEEE fma; NumPy has none): the product is exact in
    float64, the sum is rounded to odd in float64 (round to nearest plus the exact error from
    TwoSum), and rounding that to float32 is then correctly rounded (53 >= 24 + 2 bits)."""
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        fix = np.isfinite(s) & (err != 0) & even
        if fix.any():
            s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def max_nan(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """NaN if either is NaN (torch.maximum), else the larger in the order where -0.0 < +0.0."""

    def key(x: np.ndarray) -> np.ndarray:
        i = x.view(np.int32)
        return i ^ ((i >> 31) & np.int32(0x7FFFFFFF))

    nan = np.isnan(a) | np.isnan(b)
    return np.where(nan, np.float32(np.nan), np.where(key(b) > key(a), b, a)).astype(np.float32)


def _grad32(grad: np.ndarray, scale: np.float32) -> np.ndarray:
    return grad.reshape(-1).astype(np.float32) * scale


# ---------------------------------------------------------------------------------------------
# NumPy references: the specification of nd_sgd / nd_adamw


def sgd_ref(
    master: np.ndarray,
    grad: np.ndarray,
    momentum_buf: Optional[np.ndarray],
    params_out: Optional[np.ndarray],
    sc: SgdScalars,
) -> None:
    """Reference of `nd_sgd` (see kernels/optim.cu's SgdOp)."""
    check_shard("sgd", master, grad, sgd_states(sc, momentum_buf), params_out)
    check_dispatch("sgd", master)
    p = master.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        g = _grad32(grad, sc.scale)
        if sc.flags & SGD_WEIGHT_DECAY:
            g = fma(p, np.full_like(p, sc.weight_decay), g)
        if sc.flags & SGD_MOMENTUM:
            buf = momentum_buf.reshape(-1)  # type: ignore[union-attr]
            if sc.flags & SGD_FRESH_BUFFER:
                buf[...] = g
            else:
                buf[...] = fma(g, np.full_like(g, sc.one_minus_dampening), buf * sc.momentum)
            g = fma(buf, np.full_like(buf, sc.momentum), g) if sc.flags & SGD_NESTEROV else buf.copy()
        p[...] = fma(g, np.full_like(g, sc.neg_lr), p)
        if params_out is not None:
            params_out.reshape(-1)[...] = p.astype(params_out.dtype)


def adamw_ref(
    master: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    max_exp_avg_sq: Optional[np.ndarray],
    params_out: Optional[np.ndarray],
    sc: AdamWScalars,
) -> None:
    """Reference of `nd_adamw` (see kernels/optim.cu's AdamWOp)."""
    check_shard("adamw", master, grad, adamw_states(sc, exp_avg, exp_avg_sq, max_exp_avg_sq), params_out)
    check_dispatch("adamw", master)
    p, m, v = master.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        g = _grad32(grad, sc.scale)
        p[...] = p * sc.decay
        m[...] = fma(np.full_like(m, sc.lerp_coef), g - m, g if sc.flags & ADAM_LERP_FROM_END else m)
        v[...] = fma(sc.one_minus_beta2 * g, g, v * sc.beta2)
        second = v
        if sc.flags & ADAM_AMSGRAD:
            vmax = max_exp_avg_sq.reshape(-1)  # type: ignore[union-attr]
            vmax[...] = max_nan(vmax, v)
            second = vmax
        denom = np.sqrt(second) / sc.bias_correction2_sqrt + sc.eps
        p[...] = p + (sc.neg_step * m) / denom
        if params_out is not None:
            params_out.reshape(-1)[...] = p.astype(params_out.dtype)
