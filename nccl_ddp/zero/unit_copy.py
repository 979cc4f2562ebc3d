"""ZeRO-3's two copies between a unit's parameters and its `world` rank-major shards, in a few
array calls per parameter instead of one per rank: the gathered (or packed) buffer is seen as
`(world, shard_n)`, parameter i's chunks as its columns `[off, off + chunk)`. The ranks that hold
a whole chunk (all but the last ones, torch.chunk's cut) move as one 2-D assignment, the one
partial rank apart, and the ranks past the end hold no rows (only padding).

A parameter cut along a dim d > 0 (`Strided`) is seen as `(outer, size, inner)`; rank r's
chunk holds its `counts[r]` rows of the middle dim as one contiguous `(outer, counts[r], inner)`
block (padding after it), which lands in the unsharded array as a strided region: one 3-D
assignment per rank.

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


class Strided(NamedTuple):
    """Parameter `param` cut along a dim d > 0, seen as `(outer, size, inner)` (the dims before d,
    d, the dims after it): its chunk at `offset` of every rank's shard holds rank r's rows
    `[r * rows, r * rows + counts[r])` of the middle dim as a contiguous `(outer, counts[r],
    inner)` block, the rest of the chunk (`outer * rows * inner` elements) padding."""

    param: int
    offset: int
    outer: int
    size: int
    rows: int
    inner: int
    counts: Tuple[int, ...]


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


def copy_out_strided(plans: Sequence[Strided], parts: Sequence[Any], outs: Sequence[Any]) -> None:
    """Each strided parameter's blocks out of the ranks' shards (`parts[r]`: rank r's, flat; a
    gathered buffer's `reshape(world, -1)` or an in-place all-gather's inputs) into
    `outs[param]` (flat, its full numel): rank r's block into rows `[r * rows, r * rows + counts[r])`."""
    for s in plans:
        dst = outs[s.param].reshape(s.outer, s.size, s.inner)
        for r, n in enumerate(s.counts):
            if n:
                block = parts[r][s.offset : s.offset + s.outer * n * s.inner]
                dst[:, r * s.rows : r * s.rows + n] = block.reshape(s.outer, n, s.inner)


def pack_strided(plans: Sequence[Strided], packed: Any, world: int, grads: Sequence[Optional[Any]]) -> None:
    """Rank r's rows of every strided grad (`grads[k]` for `plans[k]`, flat, full numel) as its
    contiguous block of rank r's shard of `packed` (cast to its dtype), the chunk's padding and
    a missing grad (None) as zeros."""
    p = packed.reshape(world, -1)
    for s, g in zip(plans, grads):
        cols = p[:, s.offset : s.offset + s.outer * s.rows * s.inner]
        if g is None:
            cols[...] = 0
            continue
        src = g.reshape(s.outer, s.size, s.inner)
        for r, n in enumerate(s.counts):
            m = s.outer * n * s.inner
            if n:
                cols[r, :m].reshape(s.outer, n, s.inner)[...] = src[:, r * s.rows : r * s.rows + n]
            cols[r, m:] = 0
