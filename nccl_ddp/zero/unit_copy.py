"""ZeRO-3's two copies between a unit's parameters and its `world` rank-major shards, in a few
array calls per parameter instead of one per rank: the gathered (or packed) buffer is seen as
`(world, shard_n)`, parameter i's chunks as its columns `[off, off + chunk)`. The ranks that hold
a whole chunk (all but the last ones, torch.chunk's cut) move as one 2-D assignment, the one
partial rank apart, and the ranks past the end hold no rows (only padding).

Framework-free (NumPy on the host, CuPy on a GPU: the same slicing); the plans are made once per
unit, so the hot path does no layout arithmetic.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple


class Cut(NamedTuple):
    """Parameter `param`'s place in a bucket: its chunk of `chunk` elements at `offset` of every
    rank's shard; ranks `[0, full)` hold a whole chunk, rank `full` (when `full < world`) the
    first `tail` elements of one, the ranks after it none."""

    param: int
    offset: int
    chunk: int
    full: int
    tail: int


def cut(index: int, offset: int, dim0: int, rows: int, row_numel: int) -> Cut:
    """The cut of a parameter of `dim0` rows in chunks of `rows` rows of `row_numel` elements."""
    if rows == 0:  # no rows at all: nothing to move
        return Cut(index, offset, 0, 0, 0)
    full, rest = divmod(dim0, rows)
    return Cut(index, offset, rows * row_numel, full, rest * row_numel)


def copy_out(cuts: Sequence[Cut], gathered: Any, world: int, outs: Sequence[Any]) -> None:
    """Each parameter's rows out of the `world` gathered shards (`gathered`: flat, rank after
    rank) into `outs[param]` (flat, its full numel)."""
    g = gathered.reshape(world, -1)
    for i, off, chunk, full, tail in cuts:
        if chunk == 0:
            continue
        dst = outs[i]
        if full:
            dst[: full * chunk].reshape(full, chunk)[...] = g[:full, off : off + chunk]
        if tail:
            dst[full * chunk : full * chunk + tail] = g[full, off : off + tail]


def copy_out_parts(cuts: Sequence[Cut], outs: Sequence[Any], parts: Sequence[Any]) -> None:
    """`copy_out` from the `world` shards apart (`parts[j]`: rank j's, flat), as an all-gather
    that hands each rank's input in place gives them: one contiguous copy per rank and
    parameter, no gathered buffer in between."""
    for i, off, chunk, full, tail in cuts:
        if chunk == 0:
            continue
        dst = outs[i]
        for j in range(full):
            dst[j * chunk : (j + 1) * chunk] = parts[j][off : off + chunk]
        if tail:
            dst[full * chunk : full * chunk + tail] = parts[full][off : off + tail]


def pack(cuts: Sequence[Cut], packed: Any, world: int, grads: Sequence[Optional[Any]]) -> None:
    """Rank r's rows of every grad (`grads[k]` for `cuts[k]`, flat, full numel) into rank r's
    shard of `packed` (flat, rank after rank; cast to its dtype); padding rows and a missing
    grad (None) as zeros. Alignment gaps between chunks are left as they are: no parameter
    reads them."""
    p = packed.reshape(world, -1)
    for (_, off, chunk, full, tail), g in zip(cuts, grads):
        if chunk == 0:
            continue
        cols = p[:, off : off + chunk]
        if g is None:
            cols[...] = 0
            continue
        if full:
            cols[:full] = g[: full * chunk].reshape(full, chunk)
        if full < world:
            last = cols[full]
            last[:tail] = g[full * chunk : full * chunk + tail]
            last[tail:] = 0
            cols[full + 1 :] = 0


def bucket_cuts(
    params: Sequence[int],
    offsets: Sequence[int],
    dims0: Sequence[int],
    rows: Sequence[int],
    row_numel: Sequence[int],
) -> Tuple[Cut, ...]:
    """The cuts of one bucket's parameters (`params[k]` at `offsets[k]`; the per-parameter
    tables indexed by parameter)."""
    return tuple(cut(i, off, dims0[i], rows[i], row_numel[i]) for i, off in zip(params, offsets))
