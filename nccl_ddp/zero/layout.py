"""Shard layout (ZeRO): which contiguous slice of every flat bucket each rank owns.

Megatron's distributed-optimizer layout: shards cut the flat bucket, not the parameter list, so
every rank owns the same number of elements of every bucket and a parameter may span two (or
more) shards. A bucket's length is padded to `world * shard_numel`, with `shard_numel` a whole
number of `align_bytes` units, so every shard starts aligned and a reduce-scatter / all-gather
sees equal chunks. `pieces(rank)` maps parameter element ranges to shard element ranges: what the
optimizer steps, what a checkpoint slices. Plain, frozen data: memory and scheduling live elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

from nccl_ddp.buckets.layout import ALIGN_BYTES, BucketLayout, aligned
from nccl_ddp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [param_lo, param_hi) of flattened parameter `param` live in bucket `bucket` at
    [bucket_lo, bucket_lo + numel), i.e. at [shard_lo, shard_lo + numel) of `rank`'s shard."""

    param: int
    bucket: int
    rank: int
    param_lo: int
    param_hi: int
    bucket_lo: int
    shard_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """`layout`: the bucket layout padded for `world` ranks (every bucket's `padded` is
    `world * shard_numel[b]`); rank r owns elements [r * shard_numel[b], (r+1) * shard_numel[b])
    of bucket b."""

    layout: BucketLayout
    world: int
    shard_numel: Tuple[int, ...]

    def owned(self, b: int, rank: int) -> Tuple[int, int]:
        """The element range of bucket `b` that `rank` owns."""
        s = self.shard_numel[b]
        return rank * s, (rank + 1) * s

    def pieces(self, rank: int) -> List[Piece]:
        """Every parameter range `rank` owns, bucket by bucket, in bucket offset order."""
        return [p for b in range(len(self.layout.buckets)) for p in self._bucket_pieces(b, rank)]

    def _bucket_pieces(self, b: int, rank: int) -> List[Piece]:
        bucket = self.layout.buckets[b]
        lo, hi = self.owned(b, rank)
        out = []
        for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                out.append(Piece(p, b, rank, start - off, end - off, start, start - lo))
        return out

    def summary(self) -> str:
        return "; ".join(
            f"bucket {b.index}: {self.world} x {s} {b.dtype}"
            for b, s in zip(self.layout.buckets, self.shard_numel)
        )


def shard_layout(layout: BucketLayout, world: int, align_bytes: int = ALIGN_BYTES) -> ShardLayout:
    """Pad every bucket of `layout` to `world` equal, `align_bytes`-aligned shards.

    Idempotent: a layout padded for `world` already is returned with the same lengths.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size for sharding must be a positive int, got {world!r}")
    buckets, shards = [], []
    for bucket in layout.buckets:
        s = aligned(-(-bucket.padded // world), bucket.dtype, align_bytes)
        shards.append(s)
        buckets.append(dataclasses.replace(bucket, padded=s * world))
    return ShardLayout(BucketLayout(tuple(buckets), layout.num_params), world, tuple(shards))
