"""Horovod's collectives on native arrays (NumPy on the host backend, CuPy on NCCL), over
nccl_ddp's functional API; each framework's facade converts its tensors (zero-copy by DLPack).

Every op is first a request matched across the members by name (negotiation.py): dtype and shape
(and root, op, scale factors, alltoall's splits) are compared before data moves, and allgather /
alltoall take every rank's rows from the matched requests. `submit_*` queue an op and return its
entry (`negotiation.wait` runs it); the plain functions submit and wait.

Horovod's meanings: Average = Sum then x 1/size (integers: the sum divided by size, rounded
toward zero); `prescale_factor` multiplies before the reduction, `postscale_factor` after it
(integers: in float64, rounded toward zero, as Horovod's CPU ops); allgather concatenates along
dim 0, whose length may differ between ranks; reducescatter splits dim 0 as Horovod does (the
first `rows % size` ranks one row more); alltoall sends `splits[j]` rows to rank j.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

import nccl_ddp as nd
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod import negotiation, requests
from nccl_ddp.horovod.arrays import NativeArray, is_float, xp_of, xp_of_array
from nccl_ddp.horovod.common import OP_NAMES, Average, Sum, check_scale, resolve_op, split_counts
from nccl_ddp.horovod.negotiation import Entry
from nccl_ddp.horovod.requests import Records, Request, dtype_code


def where_of(op: str, name: Optional[str]) -> str:
    """How errors name a collective call: `hvd.<op>`, with the call's `name` when given."""
    return f"hvd.{op}" + (f" ({name!r})" if name else "")


def reduce_args(
    op_name: str,
    name: Optional[str],
    op: object,
    average: object,
    prescale_factor: object,
    postscale_factor: object,
) -> Tuple[str, int, float, float]:
    """A reducing collective's arguments checked once for every framework: (where, op, pre, post)."""
    where = where_of(op_name, name)
    op = resolve_op(op, average, where)
    pre = check_scale(where, "prescale_factor", prescale_factor)
    return where, op, pre, check_scale(where, "postscale_factor", postscale_factor)


_OPS = {Average: "sum", Sum: "sum", 3: "min", 4: "max", 5: "prod"}
A = TypeVar("A", bound=NativeArray)


def _scale(a: NativeArray, factor: float) -> None:
    """a *= factor as Horovod's CPU ops: float16 in float32, integers in float64 (rounded toward
    zero), other floats in their own precision."""
    if factor == 1.0:
        return
    if not is_float(a):
        a[...] = (a.astype(np.float64) * factor).astype(a.dtype)
    elif np.dtype(a.dtype).itemsize == 2:
        a[...] = (a.astype(np.float32) * np.float32(factor)).astype(a.dtype)
    else:
        a *= a.dtype.type(factor)


def _finish_reduce(a: NativeArray, op: int, post: float, size: int) -> None:
    """After the sum: the post-scale, then Average's 1/size (integers: divided, toward zero)."""
    if is_float(a):
        _scale(a, post / size if op == Average else post)
        return
    _scale(a, post)
    if op == Average:
        xp = xp_of_array(a)
        a[...] = xp.sign(a) * (xp.abs(a) // size)


def _reduce_now(a: NativeArray, op: int, pre: float, post: float, group: ProcessGroup) -> NativeArray:
    _scale(a, pre)
    nd.all_reduce(a, op=_OPS[op], group=group)
    _finish_reduce(a, op, post, group.size)
    return a


def submit_allreduce(
    a: NativeArray,
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    name: Optional[str] = None,
) -> Entry:
    """Queue the in-place reduction of `a` (contiguous); the entry's result is `a`."""
    return negotiation.submit(
        group,
        "ALLREDUCE",
        name,
        lambda _: _reduce_now(a, op, pre, post, group),
        where,
        array=a,
        op=op,
        pre=pre,
        post=post,
    )


def _joined_allreduce(group: ProcessGroup, req: Request) -> None:
    """A rank inside hvd.join(): zeros into the others' allreduce of `req`."""
    shapes = requests.grouped_shapes(req) if req.kind == "GROUPED_ALLREDUCE" else [(req.shape, req.dtype)]
    xp = xp_of(group)
    for dt in dict.fromkeys(code for _, code in shapes):
        count = sum(int(np.prod(shape)) for shape, code in shapes if code == dt)
        zeros = xp.zeros(count, requests.dtype_name(dt))
        nd.all_reduce(zeros, op=_OPS[req.op], group=group)


negotiation.joined_runners.update(ALLREDUCE=_joined_allreduce, GROUPED_ALLREDUCE=_joined_allreduce)


def allreduce_(
    a: NativeArray,
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    async_op: bool = False,
    name: Optional[str] = None,
) -> Tuple[Optional[Entry], Callable[[], NativeArray]]:
    """Reduce `a` (contiguous) in place. Returns (entry or None, finish): `finish()` waits and
    returns `a`."""
    entry = submit_allreduce(a, op, pre, post, group, where, name)
    if not async_op:
        negotiation.wait(group, entry)
        return None, lambda: a
    return entry, lambda: (negotiation.wait(group, entry), a)[1]


def _grouped_extra(arrays: Sequence[NativeArray]) -> Tuple[int, ...]:
    out: List[int] = []
    for a in arrays:
        out += [a.ndim, *a.shape, dtype_code(a.dtype)]
    return tuple(out)


def _by_dtype(arrays: Sequence[NativeArray]) -> List[List[NativeArray]]:
    by: Dict[str, List[NativeArray]] = {}
    for a in arrays:
        by.setdefault(np.dtype(a.dtype).str, []).append(a)
    return list(by.values())


def submit_grouped_allreduce(
    arrays: Sequence[NativeArray],
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    name: Optional[str] = None,
) -> Entry:
    """Queue the in-place reduction of every array, one collective per dtype (fused in one
    buffer); matched as one op (Horovod's grouped allreduce), so every rank passes the same list."""
    xp = xp_of(group)

    def run(_: Records) -> Sequence[NativeArray]:
        for same in _by_dtype(arrays):
            flat = xp.concatenate([a.reshape(-1) for a in same])
            _reduce_now(flat, op, pre, post, group)
            offset = 0
            for a in same:
                a.reshape(-1)[...] = flat[offset : offset + a.size]
                offset += a.size
        return arrays

    return negotiation.submit(
        group,
        "GROUPED_ALLREDUCE",
        name,
        run,
        where,
        shape=(len(arrays),),
        dtype=dtype_code(arrays[0].dtype),
        extra=_grouped_extra(arrays),
        op=op,
        pre=pre,
        post=post,
    )


def grouped_allreduce_(
    arrays: Sequence[NativeArray],
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    name: Optional[str] = None,
) -> None:
    """Reduce every array in place (submit_grouped_allreduce, waited for)."""
    negotiation.wait(group, submit_grouped_allreduce(arrays, op, pre, post, group, where, name))


def submit_broadcast(
    a: A, root_rank: int, group: ProcessGroup, where: str, name: Optional[str] = None
) -> Entry:
    """Queue the in-place broadcast of `root_rank`'s `a` (a global rank); the result is `a`."""
    _check_root(root_rank, group, where)
    return negotiation.submit(
        group,
        "BROADCAST",
        name,
        lambda _: nd.broadcast(a, src=root_rank, group=group),
        where,
        array=a,
        root=root_rank,
    )


def broadcast_(
    a: A, root_rank: int, group: ProcessGroup, where: str = "hvd.broadcast", name: Optional[str] = None
) -> A:
    negotiation.wait(group, submit_broadcast(a, root_rank, group, where, name))
    return a


def _check_root(root_rank: int, group: ProcessGroup, where: str) -> None:
    if root_rank not in group.ranks:
        raise ConfigError(
            f"rank {nd.get_rank()}: {where}: root_rank {root_rank} is not a member of the process "
            f"set (global ranks {list(group.ranks)})"
        )


def _check_dims(a: NativeArray, where: str) -> None:
    if a.ndim == 0:
        raise ConfigError(
            f"{where}: the tensor must have at least one dimension (Horovod concatenates along "
            f"dim 0), got shape {tuple(a.shape)}"
        )


def submit_allgather(a: NativeArray, group: ProcessGroup, where: str, name: Optional[str] = None) -> Entry:
    """Queue the gather of every member's `a` along dim 0 (whose length may differ)."""
    _check_dims(a, where)

    def run(records: Records) -> NativeArray:
        rows = [r.shape[0] if r is not None else 0 for r in records]
        xp, rest, longest = xp_of(group), tuple(a.shape[1:]), max(rows)
        mine = a
        if a.shape[0] != longest:
            mine = xp.zeros((longest, *rest), a.dtype)
            mine[: a.shape[0]] = a
        out = xp.empty((group.size * longest, *rest), a.dtype)
        nd.all_gather(out, xp.ascontiguousarray(mine), group=group)
        if all(r == longest for r in rows):
            return out
        return xp.concatenate([out[i * longest : i * longest + r] for i, r in enumerate(rows)])

    return negotiation.submit(group, "ALLGATHER", name, run, where, array=a)


def allgather(a: NativeArray, group: ProcessGroup, where: str, name: Optional[str] = None) -> NativeArray:
    """Every member's `a`, concatenated along dim 0 in rank order (dim 0 may differ)."""
    out = negotiation.wait(group, submit_allgather(a, group, where, name))
    assert out is not None
    return out  # type: ignore[return-value]


def submit_reducescatter(
    a: NativeArray,
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    name: Optional[str] = None,
) -> Entry:
    """Queue the reduction of `a` over the members; the result is this rank's rows of dim 0."""
    if op not in (Average, Sum, 3, 4, 5):
        raise ConfigError(f"{where}: op {OP_NAMES.get(op, op)} is not supported by reducescatter")
    _check_dims(a, where)

    def run(_: Records) -> NativeArray:
        xp, rest = xp_of(group), tuple(a.shape[1:])
        counts = split_counts(a.shape[0], group.size)
        longest = max(counts)
        work = xp.zeros((group.size, longest, *rest), a.dtype)
        start = 0
        for i, c in enumerate(counts):
            work[i, :c] = a[start : start + c]
            start += c
        _scale(work, pre)
        out = xp.empty((longest, *rest), a.dtype)
        nd.reduce_scatter(out, work.reshape(group.size, -1), op=_OPS[op], group=group)
        _finish_reduce(out, op, post, group.size)
        return out[: counts[group.rank]]

    return negotiation.submit(group, "REDUCESCATTER", name, run, where, array=a, op=op, pre=pre, post=post)


def reducescatter(
    a: NativeArray,
    op: int,
    pre: float,
    post: float,
    group: ProcessGroup,
    where: str,
    name: Optional[str] = None,
) -> NativeArray:
    """Reduce `a` over the members; this rank gets its rows of dim 0 (Horovod's split)."""
    out = negotiation.wait(group, submit_reducescatter(a, op, pre, post, group, where, name))
    return out  # type: ignore[return-value]


def submit_alltoall(
    a: NativeArray, splits: Optional[List[int]], group: ProcessGroup, where: str, name: Optional[str] = None
) -> Entry:
    """Queue the exchange: rows `splits[j]` of `a` (in order) go to member j; the result is
    (the received rows in rank order, how many rows came from each member)."""
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
    _check_dims(a, where)
    mine = list(splits)

    def run(records: Records) -> Tuple[NativeArray, List[int]]:
        matrix = [list(r.extra) if r is not None else [0] * n for r in records]  # [i][j]: i -> j
        xp, rest = xp_of(group), tuple(a.shape[1:])
        longest = max(max(row) for row in matrix)
        send = xp.zeros((n, max(longest, 1), *rest), a.dtype)
        start = 0
        for j, s in enumerate(mine):
            send[j, :s] = a[start : start + s]
            start += s
        everything = xp.empty((n, *send.shape), a.dtype)
        nd.all_gather(everything.reshape(n, -1), send.reshape(-1), group=group)
        me = group.rank
        received = [int(matrix[i][me]) for i in range(n)]
        return xp.concatenate([everything[i, me, : received[i]] for i in range(n)]), received

    return negotiation.submit(group, "ALLTOALL", name, run, where, array=a, extra=tuple(mine))


def alltoall(
    a: NativeArray, splits: Optional[List[int]], group: ProcessGroup, where: str, name: Optional[str] = None
) -> Tuple[NativeArray, List[int]]:
    """submit_alltoall, waited for."""
    out = negotiation.wait(group, submit_alltoall(a, splits, group, where, name))
    return out  # type: ignore[return-value]


def submit_broadcast_many(
    arrays: Sequence[NativeArray], root_rank: int, group: ProcessGroup, where: str, name: Optional[str] = None
) -> Entry:
    """Queue the in-place broadcast of every array, fused into one collective per dtype."""
    _check_root(root_rank, group, where)
    xp = xp_of(group)

    def run(_: Records) -> None:
        for same in _by_dtype(arrays):
            flat = xp.concatenate([xp.ascontiguousarray(a).reshape(-1) for a in same])
            nd.broadcast(flat, src=root_rank, group=group)
            offset = 0
            for a in same:
                a[...] = flat[offset : offset + a.size].reshape(a.shape)
                offset += a.size

    dtype = dtype_code(arrays[0].dtype) if arrays else 0
    return negotiation.submit(
        group,
        "GROUPED_BROADCAST",
        name,
        run,
        where,
        shape=(len(arrays),),
        dtype=dtype,
        extra=_grouped_extra(arrays),
        root=root_rank,
    )


def broadcast_many_(
    arrays: Sequence[NativeArray],
    root_rank: int,
    group: ProcessGroup,
    where: str = "hvd.broadcast_parameters",
    name: Optional[str] = None,
) -> None:
    """Broadcast every array in place, fused into one collective per dtype (any strides)."""
    negotiation.wait(group, submit_broadcast_many(arrays, root_rank, group, where, name))
