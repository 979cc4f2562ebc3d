"""A ZeRO-3 unit's copy-out and grad pack as device work: the bucket kernels of kernels/bucket.cu
(`nccl_ddp.kernels` pack/unpack/zero_), one launch per dtype bucket whatever the parameter and
rank counts, on CuPy's current stream (the comm stream: `UnitShards` submits them there). The
host backend's per-slice NumPy copies in zero/params.py compute the same values.

Each parameter's rank-r rows are one segment: at `r * shard_n + offset` in the gathered (or
packed) buffer, at `rank_rows(i)[r]` in the flat unsharded array.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

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
    (padding rows, missing grads, alignment gaps) zero: one memset, then per grad dtype (one,
    unless the caller mixes them) one pack launch for a narrowing or same-dtype cast; a
    widening one (bf16/fp16 grads reduced in fp32), which the pack kernel does not take, packs
    into a scratch buffer of the grads' dtype and widens those ranges with one unpack. A cast
    neither kernel takes (float64 grads reduced in float32) is CuPy's, per range."""
    srcs, offsets = _segments(layout, shard_n, params, grads)
    K.zero_(pack)
    by_dtype: Dict[str, Tuple[List[Any], List[int]]] = {}
    for v, o in zip(srcs, offsets):
        group = by_dtype.setdefault(K.dtype_name(v), ([], []))
        group[0].append(v)
        group[1].append(o)
    to = K.dtype_name(pack)
    for dt, (views, offs) in by_dtype.items():
        if (dt, to) in K.PACK_PAIRS:
            K.pack(views, pack, offs)
        elif (dt, to) in K.UNPACK_PAIRS:
            narrow = scratch.get(pack.size, views[0].dtype)
            K.pack(views, narrow, offs)
            K.unpack([pack[o : o + v.size] for v, o in zip(views, offs)], narrow, offs)
        else:
            for v, o in zip(views, offs):
                pack[o : o + v.size] = v.astype(pack.dtype)


def device_add_into(outs: Sequence[Any], partial: Sequence[Any]) -> None:
    """HSDP's deferred all-reduce: each bucket's partial shard added into its newly reduced one
    (an accumulating unpack each)."""
    for out, part in zip(outs, partial):
        K.unpack([out], part, [0], accumulate=True)
