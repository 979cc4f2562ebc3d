"""CUDA launches of the fused optimizer steps (kernels/optim.cu): one launch per shard on CuPy's
current stream, grid-stride, with the float32 scalars of nccl_ddp.kernels.optim_spec."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.kernels.cuda import THREADS, backend, optim_kernel_name
from nccl_ddp.kernels.optim_spec import (
    AdamWScalars,
    SgdScalars,
    adamw_states,
    check_shard,
    sgd_states,
)
from nccl_ddp.kernels.spec import dtype_name

BLOCKS_PER_SM = 8  # 2048 resident threads per SM / 256: at most one full wave, then grid-stride


def prepare(
    op: str, master: Any, grad: Any, state: Sequence[Optional[Any]], params_out: Optional[Any], scalars: tuple
) -> Tuple[str, int, tuple]:
    """(kernel name, grid, arguments) of nd_<op>(grad, master, *state, params_out, n, *scalars)
    (the benchmark launches these directly). Without a parameter copy any instantiation serves
    (its out pointer is null): the float32 one."""
    pdtype = dtype_name(params_out) if params_out is not None else "float32"
    name = optim_kernel_name(op, dtype_name(grad), pdtype)
    grid = max(1, min(-(-master.size // (4 * THREADS)), backend()._sms(master.device.id) * BLOCKS_PER_SM))
    return name, grid, (grad, master, *state, params_out, np.int64(master.size), *scalars)


def _launch(
    op: str, master: Any, grad: Any, state: Sequence[Optional[Any]], params_out: Optional[Any], scalars: tuple
) -> None:
    if master.size == 0:
        return
    kb, dev = backend(), master.device.id
    with kb.cp.cuda.Device(dev):
        name, grid, args = prepare(op, master, grad, state, params_out, scalars)
        kb._launch(dev, name, grid, args)


def sgd(
    master: Any, grad: Any, momentum_buf: Optional[Any], params_out: Optional[Any], sc: SgdScalars
) -> None:
    """One nd_sgd launch (see optim_spec.sgd_ref)."""
    states = sgd_states(sc, momentum_buf)
    check_shard("sgd", master, grad, states, params_out)
    _launch("sgd", master, grad, [states[0][1] if states else None], params_out, sgd_args(sc))


def adamw(
    master: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Optional[Any],
    params_out: Optional[Any],
    sc: AdamWScalars,
) -> None:
    """One nd_adamw launch (see optim_spec.adamw_ref)."""
    states = adamw_states(sc, exp_avg, exp_avg_sq, max_exp_avg_sq)
    check_shard("adamw", master, grad, states, params_out)
    arrays = [a for _, a in states] + [None] * (3 - len(states))
    _launch("adamw", master, grad, arrays, params_out, adamw_args(sc))


def sgd_args(sc: SgdScalars) -> tuple:
    """nd_sgd's scalar arguments, in its parameter order."""
    return (sc.scale, sc.weight_decay, sc.momentum, sc.one_minus_dampening, sc.neg_lr, np.int32(sc.flags))


def adamw_args(sc: AdamWScalars) -> tuple:
    """nd_adamw's scalar arguments, in its parameter order."""
    return (
        sc.scale,
        sc.decay,
        sc.lerp_coef,
        sc.beta2,
        sc.one_minus_beta2,
        sc.bias_correction2_sqrt,
        sc.eps,
        sc.neg_step,
        np.int32(sc.flags),
    )
