"""Horovod's data-moving TensorFlow collectives on nccl_ddp: allgather, grouped_allgather,
broadcast, broadcast_ / broadcast_variables (in place), alltoall (horovod/tensorflow's names).

Each runs eagerly or in a graph (host_call.py) and has Horovod's gradient: an allgather's is this
rank's rows of the averaged upstream grads; a broadcast's the averaged upstream grads on the root
and zeros elsewhere; an alltoall's the alltoall of the upstream grads back by the received splits.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.arrays import host
from nccl_ddp.horovod.collectives import where_of
from nccl_ddp.horovod.common import Average
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.tensorflow.dense_reduce import reduce_dense
from nccl_ddp.horovod.tensorflow.host_call import on_host
from nccl_ddp.horovod.tensorflow.tensors import TensorLike, dense, native, sub_name, upstream


def _averaged(d: tf.Tensor, name: Optional[str], process_set: ProcessSet) -> tf.Tensor:
    where = where_of("allreduce", name)
    return reduce_dense([d], Average, 1.0, 1.0, group_of(process_set, where), where, name)[0]


def allgather(
    tensor: TensorLike,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Every rank's `tensor` concatenated along dim 0 (its length may differ between ranks)."""
    where = where_of("allgather", name)
    g = group_of(process_set, where)
    t = dense(tensor, where)

    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        return [host(collectives.allgather(native(arrays[0], g), g, where))]

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> tuple:
        (out,) = on_host(run, [x], [x.dtype], "HorovodAllgather", name)
        out.set_shape([None, *x.shape[1:]])

        def grad(dy: Optional[tf.Tensor]) -> tf.Tensor:
            (d,) = upstream([dy], [out])
            d = _averaged(d, sub_name(name, "grad"), process_set)
            rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
            counts = allgather(rows, name=sub_name(name, "grad.rows"), process_set=process_set)
            start = tf.reduce_sum(counts[: g.rank])
            return d[start : start + counts[g.rank]]

        return out, grad

    return gather(t)


def grouped_allgather(
    tensors: Sequence[TensorLike],
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> List[tf.Tensor]:
    """allgather of each tensor (one collective each)."""
    return [allgather(t, sub_name(name, str(i)), process_set=process_set) for i, t in enumerate(tensors)]


def broadcast(
    tensor: TensorLike,
    root_rank: int,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """A copy of `root_rank`'s `tensor` on every rank."""
    where = where_of("broadcast", name)
    g = group_of(process_set, where)

    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        n = native(arrays[0], g)
        collectives.broadcast_(n, root_rank, g)
        return [host(n)]

    @tf.custom_gradient
    def bcast(x: tf.Tensor) -> tuple:
        (out,) = on_host(run, [x], [x.dtype], "HorovodBroadcast", name)
        out.set_shape(x.shape)

        def grad(dy: Optional[tf.Tensor]) -> tf.Tensor:
            (d,) = upstream([dy], [out])
            d = _averaged(d, sub_name(name, "grad"), process_set)
            return d if g.ranks[g.rank] == root_rank else d * 0

        return out, grad

    return bcast(dense(tensor, where))


def broadcast_(
    variables: Sequence[tf.Variable],
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> List[TensorLike]:
    """Assign `root_rank`'s values to `variables` on every rank (one broadcast per dtype); returns
    the assigned values."""
    variables = list(variables)
    if not variables:
        return []
    where = where_of("broadcast_", name)
    g = group_of(process_set, where)
    values = [
        v.read_value() if isinstance(v, tf.Variable) else tf.convert_to_tensor(v.value) for v in variables
    ]
    outs = on_host(
        _broadcast_many(root_rank, g, where),
        values,
        [v.dtype for v in values],
        "HorovodBroadcastInplace",
        name,
    )
    return [v.assign(tf.reshape(o, v.shape)) for v, o in zip(variables, outs)]


def _broadcast_many(root_rank: int, g: ProcessGroup, where: str):  # type: ignore[no-untyped-def]
    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        natives = [native(a, g) for a in arrays]
        collectives.broadcast_many_(natives, root_rank, g)
        return [host(n) for n in natives]

    return run


def broadcast_variables(
    variables: Sequence[tf.Variable], root_rank: int, process_set: ProcessSet = global_process_set
) -> Optional[tf.Operation]:
    """Assign `root_rank`'s values to `variables` on every rank; in a graph, the op doing it."""
    assigned = broadcast_(variables, root_rank, process_set=process_set)
    return None if tf.executing_eagerly() or not assigned else tf.group(assigned)


def alltoall(
    tensor: TensorLike,
    splits: Optional[TensorLike] = None,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
    """Rows `splits[j]` of `tensor` go to rank j; returns the received rows and, with `splits`,
    how many came from each rank. `splits` may be a symbolic tensor."""
    where = where_of("alltoall", name)
    g = group_of(process_set, where)
    given = [] if splits is None else [tf.reshape(tf.cast(dense(splits, where), tf.int32), [-1])]

    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        rows = [int(s) for s in arrays[1]] if len(arrays) > 1 else None
        out, received = collectives.alltoall(native(arrays[0], g), rows, g, where)
        return [host(out), np.asarray(received, np.int32)]

    @tf.custom_gradient
    def exchange(x: tf.Tensor) -> tuple:
        out, received = on_host(run, [x, *given], [x.dtype, tf.int32], "HorovodAlltoall", name)
        out.set_shape([None, *x.shape[1:]])
        received.set_shape([g.size])

        def grad(dy: Optional[tf.Tensor], _: Optional[tf.Tensor] = None) -> tf.Tensor:
            (d,) = upstream([dy], [out])
            back = alltoall(d, received, name=sub_name(name, "grad"), process_set=process_set)
            return back[0]

        return (out, received), grad

    out, received = exchange(dense(tensor, where))
    return out if splits is None else (out, received)


__all__ = ["allgather", "alltoall", "broadcast", "broadcast_", "broadcast_variables", "grouped_allgather"]
