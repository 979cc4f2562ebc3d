"""Horovod's reducing TensorFlow collectives on nccl_ddp: allreduce, grouped_allreduce,
reducescatter, grouped_reducescatter (horovod/tensorflow's names and keywords; the data-moving ones
are in movement.py, the gradient tape in tape.py; `nccl_ddp.horovod.tensorflow` re-exports them).

Each takes and returns tensors, eagerly or in a graph (host_call.py), and has Horovod's gradient
(tf.custom_gradient): an allreduce's is the allreduce of the upstream grads with the same op and
factors; a reducescatter's the allgather of the upstream grads (times the ranks for Sum, times
the factors). `tf.IndexedSlices` are reduced as Horovod reduces them: values and indices
all-gathered (Average: values / size), only Sum or Average and no scale factors.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.arrays import host
from nccl_ddp.horovod.collectives import reduce_args
from nccl_ddp.horovod.common import OP_NAMES, Average, Sum
from nccl_ddp.horovod.compression import Compressor
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.tensorflow.dense_reduce import reduce_dense
from nccl_ddp.horovod.tensorflow.host_call import on_host
from nccl_ddp.horovod.tensorflow.movement import allgather
from nccl_ddp.horovod.tensorflow.tensors import Compression, TensorLike, dense, native, sub_name, upstream


def allreduce(
    tensor: TensorLike,
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> TensorLike:
    """The reduction of `tensor` over the ranks (Average by default), a new tensor."""
    return grouped_allreduce(
        [tensor], average, device_dense, device_sparse, compression, op,
        prescale_factor, postscale_factor, name, process_set,
    )[0]  # fmt: skip


def grouped_allreduce(
    tensors: Sequence[TensorLike],
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> List[TensorLike]:
    """Every tensor reduced, the dense ones fused into one collective per dtype."""
    slices = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if slices:
        _check_sparse(op, average, prescale_factor, postscale_factor, name)
    where, op, pre, post = reduce_args("allreduce", name, op, average, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    out: List[TensorLike] = list(tensors)
    for i in slices:
        out[i] = _allreduce_slices(tensors[i], op, sub_name(name, f"sparse{i}"), process_set)
    rest = [i for i in range(len(tensors)) if i not in slices]
    if rest:
        compressed = [compression.compress(dense(tensors[i], f"{where}: tensors[{i}]")) for i in rest]
        reduced = reduce_dense([c for c, _ in compressed], op, pre, post, g, where, name)
        for i, r, (_, ctx) in zip(rest, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


def _check_sparse(
    op: Optional[int], average: Optional[bool], pre: float, post: float, name: Optional[str]
) -> None:
    where = collectives.where_of("allreduce", name)
    if op is not None and op not in (Average, Sum):
        raise NotImplementedError(
            f"{where}: tf.IndexedSlices are reduced with op=hvd.Average or hvd.Sum only, got "
            f"{OP_NAMES.get(op, op)} (pass the dense tensor: tf.convert_to_tensor(slices))"
        )
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(
            f"{where}: prescale_factor/postscale_factor are not supported for tf.IndexedSlices"
        )


def _allreduce_slices(
    s: tf.IndexedSlices, op: int, name: Optional[str], process_set: ProcessSet
) -> tf.IndexedSlices:
    values = allgather(s.values, name=sub_name(name, "values"), process_set=process_set)
    indices = allgather(s.indices, name=sub_name(name, "indices"), process_set=process_set)
    if op == Average:
        values = values / process_set.size()
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


def reducescatter(
    tensor: TensorLike,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """The reduction of `tensor` over the ranks, this rank's rows of dim 0 (Horovod's split)."""
    return grouped_reducescatter(
        [tensor], device_dense, compression, op, name, process_set, prescale_factor, postscale_factor
    )[0]


def grouped_reducescatter(
    tensors: Sequence[TensorLike],
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[tf.Tensor]:
    """Each tensor reduced over the ranks, this rank's rows of its dim 0 (one collective each)."""
    where, op, pre, post = reduce_args("reducescatter", name, op, None, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    out = []
    for i, t in enumerate(tensors):
        named = name if len(tensors) == 1 else sub_name(name, str(i))
        compressed, ctx = compression.compress(dense(t, where))
        scattered = _scatter(compressed, op, pre, post, g, where, named, process_set)
        out.append(compression.decompress(scattered, ctx))
    return out


def _scatter(
    t: tf.Tensor, op: int, pre: float, post: float, g: ProcessGroup, where: str, name: Optional[str],
    process_set: ProcessSet,
) -> tf.Tensor:  # fmt: skip
    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        return [host(collectives.reducescatter(native(arrays[0], g), op, pre, post, g, where))]

    @tf.custom_gradient
    def scatter(x: tf.Tensor) -> tuple:
        (out,) = on_host(run, [x], [x.dtype], "HorovodReducescatter", name)
        out.set_shape([None, *x.shape[1:]])

        def grad(dy: Optional[tf.Tensor]) -> tf.Tensor:
            (d,) = upstream([dy], [out])
            factor = (g.size if op == Sum else 1) * pre * post
            if factor != 1:
                d = d * tf.cast(factor, d.dtype)
            return allgather(d, name=sub_name(name, "grad"), process_set=process_set)

        return out, grad

    return scatter(t)


__all__ = ["Compression", "allreduce", "grouped_allreduce", "grouped_reducescatter", "reducescatter"]
