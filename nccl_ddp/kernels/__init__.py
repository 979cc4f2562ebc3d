"""Bucket kernels: pack K tensors into one flat bucket, unpack it back, scale and zero buffers.

One signature for both devices; the array type picks the path. NumPy arrays run the NumPy
references below (the specification, and the host backend's implementation); CuPy arrays run the
CUDA kernels of kernels/bucket.cu (see `nccl_ddp.kernels.cuda`) on CuPy's current stream, one
launch per call whatever the tensor count, bit-identical to the references.

    pack(srcs, dst, offsets, *, scale=1.0, nonfinite_flag=None)
        dst[off_i : off_i + n_i] = cast(src_i.ravel() * scale); nonfinite_flag[0] = 1 if any value
        written is NaN/Inf (the flag is only ever set, never cleared: zero it with zero_()).
    unpack(dsts, src, offsets, *, scale=1.0, accumulate=False, nonfinite_flag=None)
        dst_i = cast(src[off_i : off_i + n_i] * scale), or dst_i += ... with accumulate=True;
        nonfinite_flag[0] = 1 if any value written is NaN/Inf (as pack's).
    flag_nonfinite(views, bucket, offsets, flag)
        flag[0] = 1 if a view holds a NaN/Inf; `views` are the bucket's own elements at
        `offsets`. For reduced values no unpack writes (grads that are views of their bucket).
        On the GPU this is the checked unpack into a scratch copy (one launch; the kernels'
        sources and destinations must not alias): it reads the views once and writes the copy.
    scale_(buf, factor)   buf *= factor, in place
    zero_(buf)            buf[...] = 0
    sgd_step(master, grad, momentum_buf, params_out, *, lr, ...)     fused SGD on one flat shard
    adamw_step(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, params_out, *, step, lr, ...)
        fused AdamW on one flat shard (kernels/optim.cu; references in optim_spec)

Offsets are in elements of the bucket dtype. Arithmetic is in float32 (float64 for float64 data):
cast(x * scale) rounds once to nearest-even; accumulate computes cast(dst + x * scale) without a
fused multiply-add.

This folder holds the Python half (loaders, launch tables, the NumPy specification); the CUDA
sources are in the repository's top-level kernels/ (kernels/README.md), shipped as nccl_ddp/_kernels.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp.kernels.cuda import kernel_source_dir
from nccl_ddp.kernels.optim_spec import adamw_ref, adamw_scalars, sgd_ref, sgd_scalars
from nccl_ddp.kernels.spec import (
    PACK_PAIRS,
    SCALE_DTYPES,
    UNPACK_PAIRS,
    acc_dtype,
    check_flag,
    check_flat,
    check_segments,
    dtype_name,
    flag_nonfinite_ref,
    pack_ref,
    scale_ref,
    unpack_ref,
    zero_ref,
)

# ---------------------------------------------------------------------------------------------
# public operations (dispatch on the array type)


def pack(
    srcs: Sequence[Any], dst: Any, offsets: Sequence[int], *, scale: float = 1.0, nonfinite_flag: Any = None
) -> None:
    """Gather `srcs` into the flat bucket `dst` at `offsets`, scaled and cast (see module doc)."""
    if _is_host(dst):
        pack_ref(srcs, dst, offsets, scale=scale, nonfinite_flag=nonfinite_flag)
    else:
        _cuda().pack(srcs, dst, offsets, scale, nonfinite_flag)


def unpack(
    dsts: Sequence[Any],
    src: Any,
    offsets: Sequence[int],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    nonfinite_flag: Any = None,
) -> None:
    """Scatter the flat bucket `src` back into `dsts`, scaled and cast (see module doc)."""
    if _is_host(src):
        unpack_ref(dsts, src, offsets, scale=scale, accumulate=accumulate, nonfinite_flag=nonfinite_flag)
    else:
        _cuda().unpack(dsts, src, offsets, scale, accumulate, nonfinite_flag)


def flag_nonfinite(views: Sequence[Any], bucket: Any, offsets: Sequence[int], flag: Any) -> None:
    """flag[0] = 1 if one of `bucket`'s views holds a NaN/Inf (see module doc)."""
    if _is_host(bucket):
        flag_nonfinite_ref(views, bucket, offsets, flag)
        return
    cuda = _cuda()
    scratch = cuda.cp.empty(bucket.size, bucket.dtype)
    copies = [scratch[o : o + v.size] for v, o in zip(views, offsets)]
    cuda.unpack(copies, bucket, offsets, 1.0, False, flag)


def scale_(buf: Any, factor: float) -> None:
    """buf *= factor in place (a flat contiguous float buffer)."""
    if _is_host(buf):
        scale_ref(buf, factor)
    else:
        _cuda().scale_(buf, factor)


def zero_(buf: Any) -> None:
    """buf[...] = 0 in place (any dtype; contiguous)."""
    if _is_host(buf):
        zero_ref(buf)
    else:
        _cuda().zero_(buf)


def sgd_step(
    master: Any,
    grad: Any,
    momentum_buf: Optional[Any],
    params_out: Optional[Any],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    fresh_buffer: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """torch.optim.SGD's step on one flat float32 shard, in place: grad (float32/bfloat16/float16)
    times grad_scale, master and momentum_buf (float32; None without momentum) updated,
    params_out (float32/bfloat16/float16, or None) := the new master cast. `fresh_buffer`: the
    momentum buffer has no value yet (torch's first step: buf = grad)."""
    sc = sgd_scalars(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        fresh_buffer=fresh_buffer,
        grad_scale=grad_scale,
    )
    if _is_host(master):
        sgd_ref(master, grad, momentum_buf, params_out, sc)
    else:
        _cuda_optim().sgd(master, grad, momentum_buf, params_out, sc)


def adamw_step(
    master: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Optional[Any],
    params_out: Optional[Any],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """torch.optim.AdamW's step on one flat float32 shard, in place (see sgd_step); `step` is
    this step's number (1 first); max_exp_avg_sq only with amsgrad."""
    sc = adamw_scalars(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        grad_scale=grad_scale,
    )
    if _is_host(master):
        adamw_ref(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, params_out, sc)
    else:
        _cuda_optim().adamw(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, params_out, sc)


def _is_host(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _cuda() -> Any:
    from nccl_ddp.kernels import cuda

    return cuda.backend()


def _cuda_optim() -> Any:
    from nccl_ddp.kernels import cuda_optim

    return cuda_optim


__all__ = [
    "pack",
    "unpack",
    "flag_nonfinite",
    "scale_",
    "zero_",
    "sgd_step",
    "adamw_step",
    "sgd_ref",
    "adamw_ref",
    "kernel_source_dir",
    "PACK_PAIRS",
    "UNPACK_PAIRS",
    "SCALE_DTYPES",
    "acc_dtype",
    "check_flag",
    "check_flat",
    "check_segments",
    "dtype_name",
    "flag_nonfinite_ref",
    "pack_ref",
    "unpack_ref",
    "scale_ref",
    "zero_ref",
]
