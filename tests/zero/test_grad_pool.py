"""ZeRO-2's GradPool: a reused bucket buffer is cleared only where no parameter lies (the pack
writes every parameter's range), and what a pack leaves there is the same as after a full zero."""

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import ParamSpec, assign_buckets
from nccl_ddp.device.host import HostDevice
from nccl_ddp.zero.reduce_scatter import GradPool


def test_clear_zeroes_gaps_and_padding_only():
    specs = [ParamSpec((n,), np.dtype(np.float32)) for n in (5, 3, 17)]  # 16-byte alignment: gaps
    layout = assign_buckets(specs, cap_bytes=1 << 20, first_cap_bytes=1 << 20)
    pool = GradPool(layout, HostDevice())
    (bucket,) = layout.buckets
    buf = pool.buffers[0]
    assert buf.size > sum(bucket.numels)  # there are gaps to clear
    buf[...] = 7.0
    pool.clear(0)
    owned = np.zeros(buf.size, bool)
    for o, n in zip(bucket.offsets, bucket.numels):
        owned[o : o + n] = True
    assert (buf[~owned] == 0).all() and (buf[owned] == 7).all()
    # a pack after the clear gives the bits of a pack after a full zero
    grads = [np.arange(n, dtype=np.float32) + 0.5 for n in bucket.numels]
    srcs = grads
    kernels.pack(srcs, pool.buffer(0), list(bucket.offsets))
    want = np.zeros_like(buf)
    kernels.pack(srcs, want, list(bucket.offsets))
    assert buf.tobytes() == want.tobytes()
