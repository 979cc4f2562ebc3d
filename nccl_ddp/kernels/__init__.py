"""Bucket kernels: pack K tensors into one flat bucket, unpack it back, scale and zero buffers.

One signature for both devices; the array type picks the path. NumPy arrays run the NumPy
references below (the specification, and the host backend's implementation); CuPy arrays run the
CUDA kernels of kernels/bucket.cu (see `nccl_ddp.kernels.cuda`) on CuPy's current stream, one
launch per call whatever the tensor count, bit-identical to the references.

    pack(srcs, dst, offsets, *, scale=1.0, nonfinite_flag=None)
        dst[off_i : off_i + n_i] = cast(src_i.ravel() * scale); nonfinite_flag[0] = 1 if any value
        written is NaN/Inf (the flag is only ever set, never cleared: zero it with zero_()).
    unpack(dsts, src, offsets, *, scale=1.0, accumulate=False)
        dst_i = cast(src[off_i : off_i + n_i] * scale), or dst_i += ... with accumulate=True.
    scale_(buf, factor)   buf *= factor, in place
    zero_(buf)            buf[...] = 0

Offsets are in elements of the bucket dtype. Arithmetic is in float32 (float64 for float64 data):
cast(x * scale) rounds once to nearest-even; accumulate computes cast(dst + x * scale) without a
fused multiply-add.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from nccl_ddp.kernels.cuda import kernel_source_dir
from nccl_ddp.kernels.spec import (
    PACK_PAIRS,
    SCALE_DTYPES,
    UNPACK_PAIRS,
    acc_dtype,
    check_flag,
    check_flat,
    check_segments,
    dtype_name,
    pack_ref,
    scale_ref,
    unpack_ref,
    zero_ref,
)

# ---------------------------------------------------------------------------------------------
# public operations (dispatch on the array type)


def pack(srcs: Sequence[Any], dst: Any, offsets: Sequence[int], *, scale: float = 1.0,
         nonfinite_flag: Any = None) -> None:
    """Gather `srcs` into the flat bucket `dst` at `offsets`, scaled and cast (see module doc)."""
    if _is_host(dst):
        pack_ref(srcs, dst, offsets, scale=scale, nonfinite_flag=nonfinite_flag)
    else:
        _cuda().pack(srcs, dst, offsets, scale, nonfinite_flag)


def unpack(dsts: Sequence[Any], src: Any, offsets: Sequence[int], *, scale: float = 1.0,
           accumulate: bool = False) -> None:
    """Scatter the flat bucket `src` back into `dsts`, scaled and cast (see module doc)."""
    if _is_host(src):
        unpack_ref(dsts, src, offsets, scale=scale, accumulate=accumulate)
    else:
        _cuda().unpack(dsts, src, offsets, scale, accumulate)


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


def _is_host(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _cuda():
    from nccl_ddp.kernels import cuda
    return cuda.backend()


__all__ = ["pack", "unpack", "scale_", "zero_", "kernel_source_dir", "PACK_PAIRS", "UNPACK_PAIRS",
           "SCALE_DTYPES", "acc_dtype", "check_flag", "check_flat", "check_segments", "dtype_name",
           "pack_ref", "unpack_ref", "scale_ref", "zero_ref"]
