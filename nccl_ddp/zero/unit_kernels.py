"""A ZeRO-3 unit's copy-out and grad pack as device work: the bucket kernels of kernels/bucket.cu
(`nccl_ddp.kernels` pack/unpack/zero_), one launch per dtype bucket whatever the parameter and
rank counts, on CuPy's current stream (the comm stream: `UnitShards` submits them there). The
host backend's per-slice NumPy copies in zero/params.py compute the same values.

Each parameter's rank-r rows are one segment: at `r * shard_n + offset` in the gathered (or
packed) buffer, at `rank_rows(i)[r]` in the flat unsharded array.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple

from nccl_ddp import kernels as K


class UnitRows(Protocol):
    """What the copies read of a unit's layout (zero/params.py `UnitLayout`)."""

    def rank_rows(self, i: int) -> List[Tuple[int, int]]: ...


class Scratch(Protocol):
    """Where a widening pack gets its buffer (zero/params.py `ScratchPool`)."""

    def get(self, n: int, dtype: Any) -> Any: ...


def _segments(
    layout: UnitRows, shard_n: int, params: list, arrays: Sequence[Optional[Any]]
) -> Tuple[List[Any], List[int]]:
    """(views of `arrays[k]`'s real rows of each rank, their offsets in the world-sized buffer)
    for every (parameter, offset) of `params`; a None array has none."""
    views, offsets = [], []
    for (i, off), a in zip(params, arrays):
        if a is None:
            continue
        for r, (lo, n) in enumerate(layout.rank_rows(i)):
            if n:
                views.append(a[lo : lo + n])
                offsets.append(r * shard_n + off)
    return views, offsets


def device_copy_out(layout: UnitRows, gathered: Any, shard_n: int, params: list, outs: Sequence[Any]) -> None:
    """Every parameter's rows out of the `world` gathered shards into its unsharded array: one
    unpack (the arrays are in the bucket's dtype)."""
    dsts, offsets = _segments(layout, shard_n, params, [outs[i] for i, _ in params])
    if dsts:
        K.unpack(dsts, gathered, offsets)


def device_pack(
    layout: UnitRows,
    pack: Any,
    shard_n: int,
    params: list,
    grads: Sequence[Optional[Any]],
    scratch: Scratch,
) -> None:
    """Rank r's rows of every grad into chunk r of `pack`, cast to its dtype; everything else
    (padding rows, missing grads, alignment gaps) zero. A narrowing or same-dtype cast is one
    memset and one pack; a widening one (a bf16/fp16 grad reduced in fp32), which the pack
    kernel does not take, packs into a scratch buffer of the grads' dtype and widens it whole
    with one unpack."""
    srcs, offsets = _segments(layout, shard_n, params, grads)
    if not srcs or (K.dtype_name(srcs[0]), K.dtype_name(pack)) in K.PACK_PAIRS:
        K.zero_(pack)
        if srcs:
            K.pack(srcs, pack, offsets)
        return
    narrow = scratch.get(pack.size, srcs[0].dtype)
    K.zero_(narrow)
    K.pack(srcs, narrow, offsets)
    K.unpack([pack], narrow, [0])
