"""Horovod's torch collectives (horovod/torch/mpi_ops.py's names, arguments and autograd) on
nccl_ddp's functional API: tensors cross as zero-copy DLPack views (CPU or CUDA).

`*_async` ops return an int handle for `poll` / `synchronize`. allreduce(_)_async runs
asynchronously on the group's stream; the others (several collectives each: shapes first) have
finished when their handle is returned.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod import collectives, negotiation
from nccl_ddp.horovod.arrays import NativeArray
from nccl_ddp.horovod.collectives import reduce_args, where_of
from nccl_ddp.horovod.common import Average, resolve_op
from nccl_ddp.horovod.compression import Compressor, HalfCompressor, NoneCompressor, T
from nccl_ddp.horovod.handles import new_handle, synchronize
from nccl_ddp.horovod.negotiation import Entry
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of

_Ctx = Any  # torch's autograd context: the ops keep their arguments on it as attributes


class FP16Compressor(HalfCompressor):
    """Floating-point tensors travel as torch.float16, and come back in their own dtype."""

    half = torch.float16

    @staticmethod
    def cast(tensor: T, dtype: object) -> T:
        assert isinstance(tensor, torch.Tensor) and isinstance(dtype, torch.dtype)
        return tensor.to(dtype)

    @staticmethod
    def is_float(dtype: object) -> bool:
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point


class Compression:
    """`compression=Compression.none` or `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _native(tensor: torch.Tensor, where: str) -> NativeArray:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigTypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ConfigError(f"{where}: sparse tensors are not supported ({tensor.layout}); pass a dense tensor")
    if not tensor.is_contiguous():
        raise ConfigError(f"{where}: the tensor must be contiguous (tensor.contiguous())")
    return to_native(tensor)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _to_torch(native: NativeArray, like: torch.Tensor) -> torch.Tensor:
    return from_native(native).reshape(native.shape).to(like.device)


# ---------------------------------------------------------------------------------------------
# allreduce

Tensors = Sequence[torch.Tensor]


def _handle(entry: Entry, group: ProcessGroup, output: Callable[[Any], object]) -> int:
    """A handle whose synchronize() runs the op (matched with the other ranks) and returns
    output(the op's native result)."""
    return new_handle(entry, lambda: output(negotiation.wait(group, entry)))


def allreduce_async_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Reduce `tensor` in place, asynchronously; `synchronize(handle)` returns it."""
    where, op, pre, post = reduce_args("allreduce", name, op, average, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    entry = collectives.submit_allreduce(_native(tensor, where), op, pre, post, g, where, name)
    return _handle(entry, g, lambda _: tensor)


def allreduce_async(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """As allreduce_async_, on a copy: `tensor` is not modified."""
    return allreduce_async_(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    h = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(h)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx, tensor: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet, name: Optional[str]
    ) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return allreduce_(_copy(tensor), None, name, op, pre, post, ps)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, ps = ctx.args
        return _Allreduce.apply(grad, op, pre, post, ps, None), None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: type[Compressor] = NoneCompressor,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A reduced copy of `tensor` (differentiable, as Horovod's)."""
    op = resolve_op(op, average, where_of("allreduce", name))
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, ctx)


def grouped_allreduce_async_(
    tensors: Tensors,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Reduce every tensor in place, fused into one collective per dtype."""
    where, op, pre, post = reduce_args(
        "grouped_allreduce", name, op, average, prescale_factor, postscale_factor
    )
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigTypeError(f"{where}: tensors must be a non-empty list of tensors")
    natives = [_native(t, f"{where}: tensors[{i}]") for i, t in enumerate(tensors)]
    g = group_of(process_set, where)
    entry = collectives.submit_grouped_allreduce(natives, op, pre, post, g, where, name)
    out = list(tensors)
    return _handle(entry, g, lambda _: out)


def grouped_allreduce_async(
    tensors: Tensors,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    copies = [_copy(t) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: Tensors,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> List[torch.Tensor]:
    h = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(h)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx,
        op: int,
        pre: float,
        post: float,
        ps: ProcessSet,
        name: Optional[str],
        *tensors: torch.Tensor,
    ) -> Tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, ps)
        return tuple(grouped_allreduce_([_copy(t) for t in tensors], None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: _Ctx, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, ps = ctx.args
        reduced = _GroupedAllreduce.apply(op, pre, post, ps, None, *[g.contiguous() for g in grads])
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Tensors,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: type[Compressor] = NoneCompressor,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> List[torch.Tensor]:
    """Reduced copies of `tensors`, fused per dtype (differentiable, as Horovod's)."""
    where = where_of("grouped_allreduce", name)
    op = resolve_op(op, average, where)
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigTypeError(f"{where}: tensors must be a non-empty list of tensors")
    compressed = [compression.compress(t) for t in tensors]
    out = _GroupedAllreduce.apply(
        op, prescale_factor, postscale_factor, process_set, name, *[t for t, _ in compressed]
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(out, compressed)]


# ---------------------------------------------------------------------------------------------
# allgather, broadcast


def _part(name: Optional[str], i: int) -> Optional[str]:
    """The name of the i-th op of a grouped call (Horovod's `<name>_<i>`)."""
    return None if name is None else f"{name}_{i}"


def allgather_async(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> int:
    where = where_of("allgather", name)
    g = group_of(process_set, where)
    src = tensor.detach() if tensor.is_contiguous() else _copy(tensor)
    entry = collectives.submit_allgather(_native(src, where), g, where, name)
    return _handle(entry, g, lambda out: _to_torch(out, tensor))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx, ps: ProcessSet, name: Optional[str], *tensors: torch.Tensor
    ) -> Tuple[torch.Tensor, ...]:
        ctx.rows, ctx.ps = [t.shape[0] for t in tensors], ps
        handles = [
            allgather_async(t, _part(name, i) if len(tensors) > 1 else name, ps)
            for i, t in enumerate(tensors)
        ]
        return tuple(synchronize(h) for h in handles)

    @staticmethod
    def backward(ctx: _Ctx, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.ps)
        rows = torch.tensor(ctx.rows, dtype=torch.int64).reshape(1, -1)
        everyone = synchronize(allgather_async(rows, None, ctx.ps))
        offsets = everyone[: ctx.ps.rank()].sum(dim=0)
        out = [r.narrow(0, int(o), n) for r, o, n in zip(reduced, offsets, ctx.rows)]
        return (None, None, *out)


def allgather(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 (its length may differ between ranks)."""
    return _Allgather.apply(process_set, name, tensor)[0]


def grouped_allgather(
    tensors: Tensors, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> List[torch.Tensor]:
    """`allgather` of each tensor, matched together (differentiable)."""
    return list(_Allgather.apply(process_set, name, *tensors))


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    where = where_of("broadcast", name)
    g = group_of(process_set, where)
    entry = collectives.submit_broadcast(_native(tensor, where), root_rank, g, where, name)
    return _handle(entry, g, lambda _: tensor)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    return broadcast_async_(_copy(tensor), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx, tensor: torch.Tensor, root_rank: int, name: Optional[str], ps: ProcessSet
    ) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return broadcast_(_copy(tensor), root_rank, name, ps)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        if ctx.ps.ranks[ctx.ps.rank()] != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A copy of `root_rank`'s `tensor` on every rank (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


__all__ = [
    "Compression",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
]
