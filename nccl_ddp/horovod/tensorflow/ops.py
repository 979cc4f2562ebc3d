"""Horovod's TensorFlow 2 collectives, DistributedGradientTape and Compression on nccl_ddp
(horovod/tensorflow's names; `nccl_ddp.horovod.tensorflow` re-exports them).

Collectives take and return tensors, eagerly or inside `tf.function` (there, one stateful
`tf.numpy_function` per call: ordered, never pruned; XLA cannot call back and is refused by the
TensorFlow adapter). `DistributedGradientTape` reduces the tape's grads through
`nccl_ddp.DistributedGradReducer` (our buckets, the TensorFlow adapter: eager DLPack or one
numpy_function per step in a graph; fp16 compression fused). Keras: `nccl_ddp.horovod.tensorflow.keras`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import nccl_ddp as nd
from nccl_ddp.adapters.per_variables import PerVariables
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.collectives import reduce_args, where_of
from nccl_ddp.horovod.common import Average, Sum, _host, _xp, check_scale, resolve_op
from nccl_ddp.horovod.compression import (
    Compressor,  # noqa: F401  (Horovod's name, re-exported)
    HalfCompressor,
    NoneCompressor,
)
from nccl_ddp.horovod.process_sets import global_process_set, group_of


class FP16Compressor(HalfCompressor):
    """Floating-point tensors travel as tf.float16, and come back in their own dtype."""

    half = tf.float16

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tf.cast(tensor, dtype)

    @staticmethod
    def is_float(dtype: Any) -> bool:
        return bool(dtype.is_floating)


class Compression:
    """`compression=Compression.none` or `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _dense(t: Any, where: str) -> Any:
    if isinstance(t, tf.IndexedSlices):
        return tf.convert_to_tensor(t)  # reduced dense (Horovod's sparse_as_dense)
    if isinstance(t, tf.Variable):
        return t.read_value()
    if not isinstance(t, tf.Tensor):
        try:
            return tf.convert_to_tensor(t)
        except (TypeError, ValueError) as e:
            raise ConfigTypeError(f"{where}: expected a tf.Tensor, got {type(t).__name__}") from e
    return t


def _on_host(
    fn: Callable[..., List[np.ndarray]], tensors: Sequence[Any], dtypes: Sequence[Any], name: str
) -> List[Any]:
    """`fn` on the tensors' values: directly when eager, else as one ordered numpy_function."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(o) for o in fn(*[np.asarray(t) for t in tensors])]
    return list(tf.numpy_function(fn, list(tensors), list(dtypes), stateful=True, name=name))


def _native(a: np.ndarray, group: Any) -> Any:
    """A writable contiguous copy of `a` in the group's array module."""
    xp = _xp(group)
    return np.array(a, copy=True, order="C") if xp is np else xp.asarray(a)


def allreduce(
    tensor: Any,
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """The reduction of `tensor` over the ranks (Average by default), a new tensor."""
    return grouped_allreduce(
        [tensor],
        average,
        device_dense,
        device_sparse,
        compression,
        op,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
    )[0]


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
) -> List[Any]:
    """Every tensor reduced, fused into one collective per dtype."""
    where, op, pre, post = reduce_args("allreduce", name, op, average, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    dense = [_dense(t, f"{where}: tensors[{i}]") for i, t in enumerate(tensors)]
    compressed = [compression.compress(t) for t in dense]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        natives = [_native(a, g) for a in arrays]
        collectives.grouped_allreduce_(natives, op, pre, post, g, where)
        return [_host(n).reshape(a.shape) for n, a in zip(natives, arrays)]

    ins = [c for c, _ in compressed]
    outs = _on_host(run, ins, [c.dtype for c in ins], "hvd_allreduce")
    for o, c in zip(outs, ins):
        o.set_shape(c.shape)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


def allgather(
    tensor: Any,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Every rank's `tensor` concatenated along dim 0 (its length may differ between ranks)."""
    where = where_of("allgather", name)
    g = group_of(process_set, where)
    t = _dense(tensor, where)
    (out,) = _on_host(
        lambda a: [_host(collectives.allgather(_native(a, g), g, where))], [t], [t.dtype], "hvd_allgather"
    )
    out.set_shape([None, *t.shape[1:]])
    return out


def broadcast(
    tensor: Any,
    root_rank: int,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """A copy of `root_rank`'s `tensor` on every rank."""
    where = where_of("broadcast", name)
    g = group_of(process_set, where)
    t = _dense(tensor, where)

    def run(a: np.ndarray) -> List[np.ndarray]:
        n = _native(a, g)
        collectives.broadcast_(n, root_rank, g)
        return [_host(n)]

    (out,) = _on_host(run, [t], [t.dtype], "hvd_broadcast")
    out.set_shape(t.shape)
    return out


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: Any = global_process_set
) -> Any:
    """Assign `root_rank`'s values to `variables` on every rank (one broadcast per dtype)."""
    variables = list(variables)
    if not variables:
        return None
    g = group_of(process_set, "broadcast_variables")
    values = [
        v.read_value() if isinstance(v, tf.Variable) else tf.convert_to_tensor(v.value) for v in variables
    ]

    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        natives = [_native(a, g) for a in arrays]
        collectives.broadcast_many_(natives, root_rank, g)
        return [_host(n) for n in natives]

    outs = _on_host(run, values, [v.dtype for v in values], "hvd_broadcast_variables")
    ops = [v.assign(tf.reshape(o, v.shape)) for v, o in zip(variables, outs)]
    return None if tf.executing_eagerly() else tf.group(ops)


broadcast_ = broadcast_variables


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: Optional[str] = None,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """The reduction of `tensor` over the ranks, this rank's rows of dim 0 (Horovod's split)."""
    where, op, pre, post = reduce_args("reducescatter", name, op, None, prescale_factor, postscale_factor)
    g = group_of(process_set, where)
    compressed, ctx = compression.compress(_dense(tensor, where))

    def run(a: np.ndarray) -> List[np.ndarray]:
        return [_host(collectives.reducescatter(_native(a, g), op, pre, post, g, where))]

    (out,) = _on_host(run, [compressed], [compressed.dtype], "hvd_reducescatter")
    out.set_shape([None, *compressed.shape[1:]])
    return compression.decompress(out, ctx)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Rows `splits[j]` of `tensor` go to rank j; returns the received rows and, with `splits`,
    how many came from each rank."""
    where = where_of("alltoall", name)
    g = group_of(process_set, where)
    t = _dense(tensor, where)
    given = None if splits is None else [int(s) for s in np.asarray(splits).ravel()]

    def run(a: np.ndarray) -> List[np.ndarray]:
        out, received = collectives.alltoall(_native(a, g), given, g, where)
        return [_host(out), np.asarray(received, np.int32)]

    out, received = _on_host(run, [t], [t.dtype, tf.int32], "hvd_alltoall")
    out.set_shape([None, *t.shape[1:]])
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------------------------------
# gradients


_reducers: PerVariables[nd.DistributedGradReducer] = PerVariables()


def reducer_for(variables: List[Any], op: int, compression: Any, process_set: Any, where: str) -> Any:
    """The grad reducer (our buckets) for these variables and settings, built once per set."""
    if op not in (Average, Sum):
        raise ConfigError(f"{where}: op must be hvd.Average or hvd.Sum for gradients, got {op}")
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigError(f"{where}: compression must be hvd.Compression.none or hvd.Compression.fp16")
    g = group_of(process_set, where)
    compress = "fp16" if compression is Compression.fp16 else None
    return _reducers.get(
        variables,
        (op, compress, g),  # the group itself: a new group never finds a dead one's reducer
        lambda: nd.DistributedGradReducer(variables, mean=op == Average, group=g, compress=compress),
    )


def reduce_grads(
    grads: List[Any], variables: List[Any], op: int, compression: Any, process_set: Any, where: str
) -> List[Any]:
    """The grads averaged (or summed) over the ranks; None grads stay None."""
    keep = [i for i, gr in enumerate(grads) if gr is not None]
    if not keep or group_of(process_set, where).size == 1:
        return list(grads)
    reducer = reducer_for([variables[i] for i in keep], op, compression, process_set, where)
    reduced = reducer([_dense(grads[i], where) for i in keep])
    out = list(grads)
    for i, r in zip(keep, reduced):
        out[i] = r
    return out


class _DistributedGradientTape:
    """A `tf.GradientTape` whose `gradient()` reduces the grads over the ranks."""

    def __init__(self, tape: Any, op: int, compression: Any, process_set: Any) -> None:
        self._tape, self._op, self._compression, self._process_set = tape, op, compression, process_set

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_grads(
            flat_grads,
            flat_sources,
            self._op,
            self._compression,
            self._process_set,
            "DistributedGradientTape.gradient",
        )
        return tf.nest.pack_sequence_as(grads, reduced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def DistributedGradientTape(
    gradtape: Any,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Horovod's tape wrapper: `tape.gradient(loss, variables)` returns the grads averaged over
    the ranks (through our buckets)."""
    where = "DistributedGradientTape"
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigTypeError(f"{where}: gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    op = resolve_op(op, None, where)
    if op not in (Average, Sum):
        raise ConfigError(f"{where}: op must be hvd.Average or hvd.Sum for gradients, got {op}")
    _check_predivide(where, op, gradient_predivide_factor)
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigError(f"{where}: compression must be hvd.Compression.none or hvd.Compression.fp16")
    if num_groups or groups is not None:
        raise ConfigError(f"{where}: num_groups/groups are not supported: grads are fused into our buckets")
    return _DistributedGradientTape(gradtape, op, compression, process_set)


def _check_predivide(where: str, op: int, factor: Any) -> None:
    f = check_scale(where, "gradient_predivide_factor", factor)
    if f <= 0:
        raise ConfigError(f"{where}: gradient_predivide_factor must be > 0, got {f}")
    if f != 1.0 and op != Average:
        raise ConfigError(f"{where}: gradient_predivide_factor not supported with op != Average")


__all__ = [
    "Compression",
    "DistributedGradientTape",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_",
    "broadcast_variables",
    "grouped_allreduce",
    "reducescatter",
]
