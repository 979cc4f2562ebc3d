"""Horovod's torch collectives (horovod/torch/mpi_ops.py's names, arguments and autograd) on
nccl_ddp's functional API: tensors cross as zero-copy DLPack views (CPU or CUDA).

`*_async` ops return an int handle for `poll` / `synchronize`. allreduce(_)_async runs
asynchronously on the group's stream; the others (several collectives each: shapes first) have
finished when their handle is returned.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.collectives import reduce_args, where_of
from nccl_ddp.horovod.common import Average, resolve_op
from nccl_ddp.horovod.compression import (
    Compressor,  # noqa: F401  (Horovod's name, re-exported)
    HalfCompressor,
    NoneCompressor,
)
from nccl_ddp.horovod.handles import new_handle, synchronize
from nccl_ddp.horovod.process_sets import global_process_set, group_of


class FP16Compressor(HalfCompressor):
    """Floating-point tensors travel as torch.float16, and come back in their own dtype."""

    half = torch.float16

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tensor.to(dtype)

    @staticmethod
    def is_float(dtype: Any) -> bool:
        return bool(dtype.is_floating_point)


class Compression:
    """`compression=Compression.none` or `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _native(tensor: Any, where: str) -> Any:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigTypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ConfigError(f"{where}: sparse tensors are not supported ({tensor.layout}); pass a dense tensor")
    if not tensor.is_contiguous():
        raise ConfigError(f"{where}: the tensor must be contiguous (tensor.contiguous())")
    return to_native(tensor)


def _copy(tensor: Any) -> Any:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _to_torch(native: Any, like: Any) -> Any:
    return from_native(native).reshape(native.shape).to(like.device)


# ---------------------------------------------------------------------------------------------
# allreduce


def allreduce_async_(
    tensor: Any,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """Reduce `tensor` in place, asynchronously; `synchronize(handle)` returns it."""
    where, op, pre, post = reduce_args("allreduce", name, op, average, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    work, finish = collectives.allreduce_(_native(tensor, where), op, pre, post, g, where, async_op=True)
    return new_handle(work, lambda: (finish(), tensor)[1])


def allreduce_async(
    tensor: Any,
    average: Any = None,
    name: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """As allreduce_async_, on a copy: `tensor` is not modified."""
    return allreduce_async_(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: Any,
    average: Any = None,
    name: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Any:
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, op: int, pre: float, post: float, ps: Any, name: Any) -> Any:
        ctx.args = (op, pre, post, ps)
        return allreduce_(_copy(tensor), None, name, op, pre, post, ps)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        op, pre, post, ps = ctx.args
        return _Allreduce.apply(grad, op, pre, post, ps, None), None, None, None, None, None


def allreduce(
    tensor: Any,
    average: Any = None,
    name: Any = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Any:
    """A reduced copy of `tensor` (differentiable, as Horovod's)."""
    op = resolve_op(op, average, where_of("allreduce", name))
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, ctx)


def grouped_allreduce_async_(
    tensors: Sequence[Any],
    average: Any = None,
    name: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """Reduce every tensor in place, fused into one collective per dtype."""
    where, op, pre, post = reduce_args(
        "grouped_allreduce", name, op, average, prescale_factor, postscale_factor
    )
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigTypeError(f"{where}: tensors must be a non-empty list of tensors")
    natives = [_native(t, f"{where}: tensors[{i}]") for i, t in enumerate(tensors)]
    collectives.grouped_allreduce_(natives, op, pre, post, group_of(process_set, where), where)
    out = list(tensors)
    return new_handle(None, lambda: out)


def grouped_allreduce_async(
    tensors: Sequence[Any],
    average: Any = None,
    name: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    copies = [_copy(t) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: Sequence[Any],
    average: Any = None,
    name: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> List[Any]:
    h = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(h)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Any = None,
    name: Any = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> List[Any]:
    compressed = [compression.compress(t) for t in tensors]
    out = grouped_allreduce_(
        [_copy(t) for t, _ in compressed], average, name, op, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(out, compressed)]


# ---------------------------------------------------------------------------------------------
# allgather, broadcast, reducescatter, alltoall


def allgather_async(tensor: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> int:
    out = _allgather(tensor, name, process_set)
    return new_handle(None, lambda: out)


def _allgather(tensor: Any, name: Optional[str], process_set: Any) -> Any:
    where = where_of("allgather", name)
    g = group_of(process_set, where)
    src = tensor.detach() if tensor.is_contiguous() else _copy(tensor)
    return _to_torch(collectives.allgather(_native(src, where), g, where), tensor)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, name: Any, ps: Any) -> Any:
        ctx.rows, ctx.ps = tensor.shape[0], ps
        return _allgather(tensor, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        reduced = allreduce(grad, op=Average, process_set=ctx.ps)
        rows = _allgather(torch.tensor([ctx.rows], dtype=torch.int64), None, ctx.ps)
        offset = int(rows[: ctx.ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> Any:
    """Every rank's `tensor` concatenated along dim 0 (its length may differ between ranks)."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(
    tensors: Sequence[Any], name: Optional[str] = None, process_set: Any = global_process_set
) -> List[Any]:
    """`allgather` of each tensor (one after the other: not fused)."""
    return [allgather(t, name, process_set) for t in tensors]


def broadcast_async_(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = global_process_set
) -> int:
    where = where_of("broadcast", name)
    collectives.broadcast_(_native(tensor, where), root_rank, group_of(process_set, where))
    return new_handle(None, lambda: tensor)


def broadcast_async(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = global_process_set
) -> int:
    return broadcast_async_(_copy(tensor), root_rank, name, process_set)


def broadcast_(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = global_process_set
) -> Any:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Any, root_rank: int, name: Any, ps: Any) -> Any:
        ctx.root, ctx.ps = root_rank, ps
        return broadcast_(_copy(tensor), root_rank, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        reduced = allreduce(grad, op=Average, process_set=ctx.ps)
        if ctx.ps.ranks[ctx.ps.rank()] != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = global_process_set
) -> Any:
    """A copy of `root_rank`'s `tensor` on every rank (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def reducescatter_async(
    tensor: Any,
    name: Optional[str] = None,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    out = reducescatter(tensor, name, Compression.none, op, process_set, prescale_factor, postscale_factor)
    return new_handle(None, lambda: out)


def reducescatter(
    tensor: Any,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """The reduction of `tensor` over the ranks, this rank's rows of dim 0 (Horovod's split)."""
    where, op, pre, post = reduce_args("reducescatter", name, op, None, prescale_factor, postscale_factor)
    compressed, ctx = compression.compress(tensor)
    src = compressed.detach().contiguous()
    out = collectives.reducescatter(_native(src, where), op, pre, post, group_of(process_set, where), where)
    return compression.decompress(_to_torch(out, tensor), ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[Any]:
    """`reducescatter` of each tensor (one after the other: not fused)."""
    return [
        reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
        for t in tensors
    ]


def alltoall_async(
    tensor: Any, splits: Any = None, name: Optional[str] = None, process_set: Any = global_process_set
) -> int:
    out = alltoall(tensor, splits, name, process_set)
    return new_handle(None, lambda: out)


def alltoall(
    tensor: Any, splits: Any = None, name: Optional[str] = None, process_set: Any = global_process_set
) -> Any:
    """Rows `splits[j]` of `tensor` go to rank j; returns the received rows (and, when `splits`
    was given, how many came from each rank), as Horovod's."""
    where = where_of("alltoall", name)
    given = (
        None if splits is None else [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    )
    src = tensor.detach().contiguous()
    out, received = collectives.alltoall(_native(src, where), given, group_of(process_set, where), where)
    result = _to_torch(out, tensor)
    if splits is None:
        return result
    return result, torch.tensor(received, dtype=torch.int32)


__all__ = [
    "Compression",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "reducescatter",
    "reducescatter_async",
]
