"""Horovod's torch reducescatter, alltoall and sparse allreduce (horovod/torch/mpi_ops.py's
names, arguments and autograd) on nccl_ddp's functional API; see ops.py for the others."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.arrays import NativeArray
from nccl_ddp.horovod.collectives import reduce_args, where_of
from nccl_ddp.horovod.common import Average, Sum
from nccl_ddp.horovod.compression import Compressor, NoneCompressor
from nccl_ddp.horovod.handles import synchronize
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.torch.ops import _copy, _Ctx, _handle, _native, _part, _to_torch, allgather_async

Splits = Union[None, torch.Tensor, Sequence[int]]


def _reducescatter_async(
    tensor: torch.Tensor, name: Optional[str], op: int, ps: ProcessSet, pre: float, post: float
) -> int:
    where, op, pre, post = reduce_args("reducescatter", name, op, None, pre, post)
    g = group_of(ps, where)
    src = tensor.detach().contiguous()
    entry = collectives.submit_reducescatter(_native(src, where), op, pre, post, g, where, name)
    return _handle(entry, g, lambda out: _to_torch(out, tensor))


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    return _reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)


class _Reducescatter(torch.autograd.Function):
    """Horovod's gradient: the grads gathered (times size for Sum, and the scale factors)."""

    @staticmethod
    def forward(
        ctx: _Ctx,
        op: int,
        ps: ProcessSet,
        pre: float,
        post: float,
        name: Optional[str],
        *tensors: torch.Tensor,
    ) -> Tuple[torch.Tensor, ...]:
        ctx.args = (op, ps, pre * post)
        single = len(tensors) == 1
        handles = [
            _reducescatter_async(t, name if single else _part(name, i), op, ps, pre, post)
            for i, t in enumerate(tensors)
        ]
        return tuple(synchronize(h) for h in handles)

    @staticmethod
    def backward(ctx: _Ctx, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, ps, scale = ctx.args
        factor = scale * (ps.size() if op == Sum else 1)
        handles = [allgather_async((g * factor if factor != 1 else g).contiguous(), None, ps) for g in grads]
        return (None, None, None, None, None, *[synchronize(h) for h in handles])


def reducescatter(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    compression: type[Compressor] = NoneCompressor,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The reduction of `tensor` over the ranks, this rank's rows of dim 0 (Horovod's split;
    differentiable)."""
    compressed, ctx = compression.compress(tensor)
    (out,) = _Reducescatter.apply(op, process_set, prescale_factor, postscale_factor, name, compressed)
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    compression: type[Compressor] = NoneCompressor,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[torch.Tensor]:
    """`reducescatter` of each tensor, matched together (differentiable)."""
    compressed = [compression.compress(t) for t in tensors]
    outs = _Reducescatter.apply(
        op, process_set, prescale_factor, postscale_factor, name, *[t for t, _ in compressed]
    )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, compressed)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[int]:
    return [
        _reducescatter_async(t, _part(name, i), op, process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]


def _splits(splits: Splits, where: str) -> Optional[List[int]]:
    if splits is None:
        return None
    if torch.is_tensor(splits):
        assert isinstance(splits, torch.Tensor)
        if splits.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"{where}: splits must be an int32 or int64 tensor, got {splits.dtype}")
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Queue an alltoall; synchronize returns (received rows, received splits as int32)."""
    where = where_of("alltoall", name)
    g = group_of(process_set, where)
    src = tensor.detach().contiguous()
    entry = collectives.submit_alltoall(_native(src, where), _splits(splits, where), g, where, name)

    def output(out: Tuple[NativeArray, List[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        rows, received = out
        return _to_torch(rows, tensor), torch.tensor(received, dtype=torch.int32)

    return _handle(entry, g, output)


class _Alltoall(torch.autograd.Function):
    """Horovod's gradient: the grads sent back with the received splits."""

    @staticmethod
    def forward(
        ctx: _Ctx, tensor: torch.Tensor, splits: Splits, name: Optional[str], ps: ProcessSet
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        out, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.ps, ctx.received = ps, received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor, _: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.ps))
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Rows `splits[j]` of `tensor` go to rank j; returns the received rows (and, when `splits`
    was given, how many came from each rank), as Horovod's; differentiable."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce: every rank's indices and values gathered (Average divides
    the values by size); the returned function waits and gives the (uncoalesced) sum."""
    where = where_of("sparse_allreduce", name)
    if tensor.layout != torch.sparse_coo:
        raise ConfigError(f"{where}: expected a torch.sparse_coo tensor, got {tensor.layout}")
    if op not in (Average, Sum):
        raise ConfigError(f"{where}: op must be hvd.Average or hvd.Sum for a sparse tensor")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(_copy(t.indices().t()), f"{name}.indices", process_set)
    values = allgather_async(_copy(t.values()), f"{name}.values", process_set)

    def finish() -> torch.Tensor:
        vals: torch.Tensor = synchronize(values)
        idx: torch.Tensor = synchronize(indices)
        if op == Average:
            vals = vals / process_set.size()
        return torch.sparse_coo_tensor(idx.t(), vals, t.size(), check_invariants=True)

    return finish


__all__ = [
    "alltoall",
    "alltoall_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
]
