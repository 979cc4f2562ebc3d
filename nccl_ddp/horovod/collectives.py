"""Horovod's collectives on native arrays (NumPy on the host backend, CuPy on NCCL), over
nccl_ddp's functional API; each framework's facade converts its tensors (zero-copy by DLPack).

Horovod's meanings: Average = Sum then x 1/size; `prescale_factor` multiplies before the
reduction, `postscale_factor` after it; allgather concatenates along dim 0, whose length may
differ between ranks; reducescatter splits dim 0 as Horovod does (the first `rows % size` ranks
one row more); alltoall sends `splits[j]` rows to rank j. Ranks whose shapes or dtypes disagree
get `RankMismatchError` on every rank, naming them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, RankMismatchError
from nccl_ddp.horovod.common import (
    OP_NAMES,
    Average,
    Sum,
    _host,
    _xp,
    check_scale,
    resolve_op,
    split_counts,
)


def where_of(op: str, name: Optional[str]) -> str:
    """How errors name a collective call: `hvd.<op>`, with the call's `name` when given."""
    return f"hvd.{op}" + (f" ({name!r})" if name else "")


def reduce_args(
    op_name: str, name: Optional[str], op: Any, average: Any, prescale_factor: Any, postscale_factor: Any
) -> Tuple[str, int, float, float]:
    """A reducing collective's arguments checked once for every framework: (where, op, pre, post)."""
    where = where_of(op_name, name)
    op = resolve_op(op, average, where)
    pre = check_scale(where, "prescale_factor", prescale_factor)
    return where, op, pre, check_scale(where, "postscale_factor", postscale_factor)


_OPS = {Average: "sum", Sum: "sum", 3: "min", 4: "max", 5: "prod"}
MAX_DIMS = 16  # of a tensor that allgather / alltoall exchange shapes for
_DTYPES: Dict[int, str] = {
    np.dtype(t).num: np.dtype(t).name
    for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
}


def _is_float(a: Any) -> bool:
    return np.dtype(a.dtype).kind == "f" or np.dtype(a.dtype).name == "bfloat16"


def _scale(a: Any, factor: float) -> None:
    if factor != 1.0:
        a *= a.dtype.type(factor)


def allreduce_(
    a: Any, op: int, prescale: float, postscale: float, group: Any, where: str, async_op: bool = False
) -> Tuple[Any, Callable[[], Any]]:
    """Reduce `a` (contiguous) in place. Returns (work or None, finish): `finish()` waits and
    applies the post-scale (and Average's 1/size), returning `a`."""
    integer = not _is_float(a)
    if integer and (prescale != 1.0 or postscale != 1.0):
        raise ConfigError(
            f"{where}: prescale_factor/postscale_factor need a floating-point tensor, got {a.dtype}"
        )
    nd_op = "avg" if integer and op == Average else _OPS[op]
    _scale(a, prescale)
    post = postscale / group.size if op == Average and not integer else postscale
    work = nd.all_reduce(a, op=nd_op, group=group, async_op=True)

    def finish() -> Any:
        work.wait()
        _scale(a, post)
        return a

    if not async_op:
        finish()
        return None, lambda: a
    return work, finish


def grouped_allreduce_(
    arrays: Sequence[Any], op: int, prescale: float, postscale: float, group: Any, where: str
) -> None:
    """Reduce every array in place, one collective per dtype (the arrays fused in one buffer)."""
    by_dtype: dict = {}
    for a in arrays:
        by_dtype.setdefault(np.dtype(a.dtype).str, []).append(a)
    xp = _xp(group)
    for same in by_dtype.values():
        flat = xp.concatenate([a.reshape(-1) for a in same]) if len(same) > 1 else same[0].reshape(-1)
        allreduce_(flat, op, prescale, postscale, group, where)
        if len(same) > 1:
            offset = 0
            for a in same:
                a.reshape(-1)[...] = flat[offset : offset + a.size]
                offset += a.size


def broadcast_(a: Any, root_rank: int, group: Any) -> Any:
    return nd.broadcast(a, src=root_rank, group=group)


def _header(a: Any, extra: Sequence[int] = ()) -> np.ndarray:
    """[ndim, dtype number, shape padded with -1 to MAX_DIMS, *extra] of `a`."""
    shape = list(a.shape)
    h = np.full(2 + MAX_DIMS + len(extra), -1, np.int64)
    h[0], h[1] = len(shape), np.dtype(a.dtype).num
    h[2 : 2 + len(shape)] = shape
    h[2 + MAX_DIMS :] = extra
    return h


def _exchange_headers(a: Any, group: Any, where: str, extra: Sequence[int] = ()) -> np.ndarray:
    """Every member's header (one all-gather); ranks whose rank/dims after the first/dtype
    differ are named on every rank."""
    if a.ndim == 0 or a.ndim > MAX_DIMS:
        raise ConfigError(
            f"{where}: the tensor must have 1 to {MAX_DIMS} dimensions (Horovod concatenates "
            f"along dim 0), got shape {tuple(a.shape)}"
        )
    xp = _xp(group)
    mine = _header(a, extra)
    out = xp.zeros((group.size, mine.size), np.int64)
    nd.all_gather(out, xp.asarray(mine), group=group)
    headers = _host(out)
    key = np.concatenate([headers[:, :2], headers[:, 3 : 2 + MAX_DIMS]], axis=1)
    differ = [i for i in range(group.size) if not np.array_equal(key[i], key[0])]
    if differ:
        shapes = {
            group.ranks[i]: (tuple(int(d) for d in h[2 : 2 + h[0]]), _DTYPES.get(int(h[1]), int(h[1])))
            for i, h in enumerate(headers)
        }
        raise RankMismatchError(
            f"rank {nd.get_rank()}: {where}: mismatched tensors across ranks, (shape, dtype) by "
            f"rank: {shapes}; every rank must pass the same dtype and the same dimensions after "
            "the first"
        )
    return headers


def allgather(a: Any, group: Any, where: str) -> Any:
    """Every member's `a`, concatenated along dim 0 in rank order (dim 0 may differ)."""
    headers = _exchange_headers(a, group, where)
    rows = [int(h[2]) for h in headers]
    xp, rest, longest = _xp(group), tuple(a.shape[1:]), max(rows)
    mine = a
    if a.shape[0] != longest:
        mine = xp.zeros((longest, *rest), a.dtype)
        mine[: a.shape[0]] = a
    out = xp.empty((group.size * longest, *rest), a.dtype)
    nd.all_gather(out, xp.ascontiguousarray(mine), group=group)
    if all(r == longest for r in rows):
        return out
    return xp.concatenate([out[i * longest : i * longest + r] for i, r in enumerate(rows)])


def reducescatter(a: Any, op: int, prescale: float, postscale: float, group: Any, where: str) -> Any:
    """Reduce `a` over the members; this rank gets its rows of dim 0 (Horovod's split)."""
    if op not in (Average, Sum, 3, 4, 5):
        raise ConfigError(f"{where}: op {OP_NAMES.get(op, op)} is not supported by reducescatter")
    if a.ndim == 0:
        raise ConfigError(f"{where}: the tensor must have at least one dimension, got a scalar")
    xp, rest = _xp(group), tuple(a.shape[1:])
    counts = split_counts(a.shape[0], group.size)
    longest = max(counts)
    work = xp.zeros((group.size, longest, *rest), a.dtype)
    start = 0
    for i, c in enumerate(counts):
        work[i, :c] = a[start : start + c]
        start += c
    _scale(work, prescale)
    out = xp.empty((longest, *rest), a.dtype)
    nd.reduce_scatter(out, work.reshape(group.size, -1), op=_OPS[op], group=group)
    post = postscale / group.size if op == Average else postscale
    _scale(out, post)
    return out[: counts[group.rank]]


def alltoall(a: Any, splits: Optional[List[int]], group: Any, where: str) -> Tuple[Any, List[int]]:
    """Rows `splits[j]` of `a` (in order) go to member j; returns what this rank received, in
    rank order, and how many rows came from each member."""
    n = group.size
    if splits is None:
        if a.ndim == 0 or a.shape[0] % n:
            raise ConfigError(
                f"{where}: without splits, dim 0 ({a.shape[0] if a.ndim else 'scalar'}) must be "
                f"divisible by the number of ranks ({n}); pass splits=[rows for each rank]"
            )
        splits = [a.shape[0] // n] * n
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != a.shape[0]:
        raise ConfigError(
            f"{where}: splits {list(splits)} must hold {n} non-negative row counts (one per rank) "
            f"summing to dim 0 of the tensor ({a.shape[0]})"
        )
    headers = _exchange_headers(a, group, where, splits)
    matrix = headers[:, 2 + MAX_DIMS :]  # matrix[i][j]: rows member i sends to member j
    xp, rest, longest = _xp(group), tuple(a.shape[1:]), int(matrix.max()) if matrix.size else 0
    send = xp.zeros((n, max(longest, 1), *rest), a.dtype)
    start = 0
    for j, s in enumerate(splits):
        send[j, :s] = a[start : start + s]
        start += s
    everything = xp.empty((n, *send.shape), a.dtype)
    nd.all_gather(everything.reshape(n, -1), send.reshape(-1), group=group)
    me = group.rank
    received = [int(matrix[i][me]) for i in range(n)]
    out = xp.concatenate([everything[i, me, : received[i]] for i in range(n)])
    return out, received


def broadcast_many_(arrays: Sequence[Any], root_rank: int, group: Any) -> None:
    """Broadcast every array in place, fused into one collective per dtype (any strides)."""
    by_dtype: dict = {}
    for a in arrays:
        by_dtype.setdefault(np.dtype(a.dtype).str, []).append(a)
    xp = _xp(group)
    for same in by_dtype.values():
        flat = xp.concatenate([xp.ascontiguousarray(a).reshape(-1) for a in same])
        nd.broadcast(flat, src=root_rank, group=group)
        offset = 0
        for a in same:
            a[...] = flat[offset : offset + a.size].reshape(a.shape)
            offset += a.size
