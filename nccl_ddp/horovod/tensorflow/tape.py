"""Horovod's DistributedGradientTape and PartialDistributedGradientTape on nccl_ddp: `gradient()`
returns the grads averaged (or summed) over the ranks through `nccl_ddp.DistributedGradReducer`
(our buckets and the TensorFlow adapter: eager by DLPack, one numpy_function a step in a graph;
fp16 fused), one reducer per set of variables, built at its first use.

`None` grads stay `None`. `tf.IndexedSlices` grads are reduced dense with `sparse_as_dense=True`,
else as Horovod reduces slices (values and indices all-gathered). Local sources
(`register_local_source`, a partial tape's `local_layers`) are not reduced: with
`scale_local_gradients` (the default) their grads are divided by the number of ranks, as Horovod's.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

import nccl_ddp as nd
from nccl_ddp.adapters.per_variables import PerVariables
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod.common import Average, Sum, check_scale, resolve_op
from nccl_ddp.horovod.compression import Compressor
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.tensorflow.ops import allreduce
from nccl_ddp.horovod.tensorflow.tensors import Compression, TensorLike, dense

_reducers: PerVariables[nd.DistributedGradReducer] = PerVariables()


def reducer_for(
    variables: List[tf.Variable], op: int, compression: type[Compressor], process_set: ProcessSet, where: str
) -> nd.DistributedGradReducer:
    """The grad reducer (our buckets) for these variables and settings, built once per set."""
    check_grad_args(where, op, 1.0, compression)
    g = group_of(process_set, where)
    compress = "fp16" if compression is Compression.fp16 else None
    return _reducers.get(
        variables,
        (op, compress, g),  # the group itself: a new group never finds a dead one's reducer
        lambda: nd.DistributedGradReducer(variables, mean=op == Average, group=g, compress=compress),
    )


def reduce_grads(
    grads: Sequence[Optional[TensorLike]],
    variables: Sequence[tf.Variable],
    op: int,
    compression: type[Compressor],
    process_set: ProcessSet,
    where: str,
    sparse_as_dense: bool = True,
    local: Sequence[bool] = (),
) -> List[Optional[TensorLike]]:
    """The grads averaged (or summed) over the ranks; None grads stay None; `local[i]` grads
    are divided by the number of ranks instead."""
    out = list(grads)
    size = group_of(process_set, where).size
    local = list(local) or [False] * len(grads)
    for i, gr in enumerate(grads):
        if gr is not None and local[i] and size > 1:
            if isinstance(gr, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(gr.values / size, gr.indices, gr.dense_shape)
            else:
                out[i] = dense(gr, where) / size
    if size == 1:
        return out
    sparse = [i for i, gr in enumerate(grads) if isinstance(gr, tf.IndexedSlices) and not local[i]]
    if not sparse_as_dense:
        for i in sparse:
            out[i] = allreduce(grads[i], op=op, process_set=process_set)
    keep = [i for i, gr in enumerate(grads) if gr is not None and not local[i]]
    if not sparse_as_dense:
        keep = [i for i in keep if i not in sparse]
    if keep:
        reducer = reducer_for([variables[i] for i in keep], op, compression, process_set, where)
        for i, r in zip(keep, reducer([dense(grads[i], where) for i in keep])):
            out[i] = r
    return out


def check_grad_args(where: str, op: int, predivide: float, compression: type[Compressor]) -> None:
    if op not in (Average, Sum):
        raise ConfigError(f"{where}: op must be hvd.Average or hvd.Sum for gradients, got {op}")
    f = check_scale(where, "gradient_predivide_factor", predivide)
    if f <= 0:
        raise ConfigError(f"{where}: gradient_predivide_factor must be > 0, got {f}")
    if f != 1.0 and op != Average:
        raise ConfigError(f"{where}: gradient_predivide_factor not supported with op != Average")
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigError(f"{where}: compression must be hvd.Compression.none or hvd.Compression.fp16")


class _DistributedGradientTape:
    """A `tf.GradientTape` whose `gradient()` reduces the grads over the ranks."""

    def __init__(
        self,
        tape: tf.GradientTape,
        op: int,
        compression: type[Compressor],
        sparse_as_dense: bool,
        process_set: ProcessSet,
        scale_local_gradients: bool,
    ) -> None:
        self._tape, self._op, self._compression = tape, op, compression
        self._sparse_as_dense, self._process_set = sparse_as_dense, process_set
        self._scale_local = scale_local_gradients
        self._local: Dict[int, tf.Variable] = {}

    def register_local_source(self, source: tf.Variable) -> None:
        """`source`'s grads stay this rank's (not reduced), e.g. a model-parallel layer's."""
        self._local[id(source)] = source

    def _is_local(self, source: tf.Variable) -> bool:
        return self._local.get(id(source)) is source

    def gradient(
        self, target: TensorLike, sources: object, output_gradients: object = None, **kwargs: object
    ) -> object:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)
        local = [self._is_local(s) for s in flat_sources]
        reduced = reduce_grads(
            flat_grads, flat_sources, self._op, self._compression, self._process_set,
            "DistributedGradientTape.gradient", self._sparse_as_dense,
            [lo and self._scale_local for lo in local],
        )  # fmt: skip
        for i, lo in enumerate(local):
            if lo and not self._scale_local:
                reduced[i] = flat_grads[i]
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(
        self, target: TensorLike, sources: Sequence[tf.Variable], output_gradients: object = None
    ) -> Tuple[List[Tuple[tf.Variable, TensorLike]], List[Tuple[tf.Variable, TensorLike]]]:
        """([(local source, grad)], [(other source, reduced grad)])."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, tf.nest.flatten(grads, expand_composites=False)))
        return [p for p in pairs if self._is_local(p[0])], [p for p in pairs if not self._is_local(p[0])]

    def __getattr__(self, name: str) -> object:
        return getattr(self._tape, name)


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: object = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> _DistributedGradientTape:
    """Horovod's tape wrapper: `tape.gradient(loss, variables)` returns the grads averaged over
    the ranks (through our buckets)."""
    where = "DistributedGradientTape"
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigTypeError(f"{where}: gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    op = resolve_op(op, None, where)
    check_grad_args(where, op, gradient_predivide_factor, compression)
    if num_groups or groups is not None:
        raise ConfigError(f"{where}: num_groups/groups are not supported: grads are fused into our buckets")
    return _DistributedGradientTape(
        gradtape, op, compression, sparse_as_dense, process_set, scale_local_gradients
    )


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: object = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Sequence[object] = (),
    scale_local_gradients: bool = True,
) -> _DistributedGradientTape:
    """A DistributedGradientTape whose `local_layers`' trainable weights are local sources."""
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    for layer in local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]:
        if not isinstance(layer, tf.keras.layers.Layer):
            raise ConfigTypeError(
                "PartialDistributedGradientTape: local_layers must be Keras layers, got "
                f"{type(layer).__name__}"
            )
        for w in layer.trainable_weights:
            tape.register_local_source(w)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
