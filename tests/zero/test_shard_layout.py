"""The ZeRO shard layout: equal aligned shards cut through the flat bucket, parameters spanning
shards, and the param-range -> shard-range map covering every element exactly once."""

import numpy as np
import pytest

from nccl_ddp.buckets.layout import ParamSpec, assign_buckets
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.layout import shard_layout

F32, BF16ISH = np.dtype(np.float32), np.dtype(np.float16)


def layout_of(sizes, dtype=F32, cap=1 << 20):
    return assign_buckets([ParamSpec((n,), np.dtype(dtype)) for n in sizes], cap, cap)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("sizes", [[5, 17, 3, 100], [1], [64, 64], [1000, 1, 999]])
def test_shards_equal_aligned_and_cover_every_element_once(world, sizes):
    base = layout_of(sizes, cap=256)
    shards = shard_layout(base, world)
    for b, (old, new) in enumerate(zip(base.buckets, shards.layout.buckets)):
        s = shards.shard_numel[b]
        assert new.padded == world * s >= old.padded
        assert s * new.dtype.itemsize % 16 == 0  # every shard starts 16-byte aligned
        assert new.padded - old.padded < world * (16 // new.dtype.itemsize) + world
        assert (new.params, new.offsets, new.numels) == (old.params, old.offsets, old.numels)
    # every element of every parameter is owned by exactly one rank, at the right shard offset
    for p, n in enumerate(sizes):
        seen = np.zeros(n, np.int64)
        b, slot = shards.layout.locate(p)
        off = shards.layout.buckets[b].offsets[slot]
        for piece in (q for r in range(world) for q in shards.pieces(r) if q.param == p):
            lo, hi = shards.owned(piece.bucket, piece.rank)
            assert lo <= piece.bucket_lo and piece.bucket_lo + piece.numel <= hi
            assert piece.bucket_lo == off + piece.param_lo
            assert piece.shard_lo == piece.bucket_lo - lo
            seen[piece.param_lo : piece.param_hi] += 1
        assert (seen == 1).all(), (p, seen)


def test_a_parameter_spans_two_shards():
    # one bucket [0..40) of float32: 37 elements of param 0; world 2 -> shards of 20 elements
    shards = shard_layout(layout_of([37]), 2)
    assert shards.shard_numel == (20,)
    (a,), (b,) = shards.pieces(0), shards.pieces(1)
    assert (a.param_lo, a.param_hi, a.shard_lo) == (0, 20, 0)
    assert (b.param_lo, b.param_hi, b.shard_lo) == (20, 37, 0)


def test_a_rank_may_own_only_padding():
    shards = shard_layout(layout_of([3]), 3)
    assert [len(shards.pieces(r)) for r in range(3)] == [1, 0, 0]


def test_idempotent_and_bad_world():
    shards = shard_layout(layout_of([37, 5], dtype=BF16ISH), 3)
    again = shard_layout(shards.layout, 3)
    assert again == shards
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="world size"):
            shard_layout(shards.layout, bad)
