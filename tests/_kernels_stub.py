"""TEMPORARY NumPy stand-in for nccl_ddp.kernels until it lands (same signatures)."""
import sys

import numpy as np


def pack(srcs, dst, offsets, *, scale=1.0, nonfinite_flag=None):
    for s, o in zip(srcs, offsets):
        v = dst[o:o + s.size]
        v[...] = s.reshape(-1)
        if scale != 1.0:
            v *= v.dtype.type(scale)


def unpack(dsts, src, offsets, *, scale=1.0, accumulate=False):
    for d, o in zip(dsts, offsets):
        v = src[o:o + d.size].reshape(d.shape) * (scale if scale != 1.0 else 1)
        if accumulate:
            d += v.astype(d.dtype)
        else:
            d[...] = v


def scale_(buf, f):
    buf *= buf.dtype.type(f)


def zero_(buf):
    buf[...] = 0


def install():
    try:
        import nccl_ddp.kernels  # noqa: F401
    except ImportError:
        sys.modules["nccl_ddp.kernels"] = sys.modules[__name__]
        import nccl_ddp
        nccl_ddp.kernels = sys.modules[__name__]
