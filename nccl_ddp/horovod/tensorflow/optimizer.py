"""Horovod's Keras `DistributedOptimizer` and `PartialDistributedOptimizer` for Keras 3
(horovod/tensorflow/keras's signatures), on `nccl_ddp.keras.DistributedOptimizer`: an optimizer of
the given one's class whose `apply()` all-reduces the grads through our buckets before Keras clips
and applies them (Horovod hooked Keras 2's `get_gradients` / `_aggregate_gradients`, which Keras 3
optimizers no longer have).

Horovod's extras: `register_local_var(v)` (and a partial optimizer's `local_layers`) keeps `v`'s
grads on this rank, divided by the number of ranks with `scale_local_gradients`;
`_compute_gradients(loss, var_list, tape=None)` returns the reduced (grad, variable) pairs, which
the next `apply_gradients` applies without reducing again; `backward_passes_per_step=N` is Keras
3's `gradient_accumulation_steps=N` (applied every N-th step; Horovod's sum of the N unless
`average_aggregated_gradients`), its count in `_agg_helper.counter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from nccl_ddp.adapters.keras.adapter import DistributedOptimizer as keras_optimizer
from nccl_ddp.adapters.keras.adapter import _AllReduceBeforeApply
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod.common import Average, resolve_op
from nccl_ddp.horovod.compression import Compressor
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set
from nccl_ddp.horovod.tensorflow.tape import check_grad_args
from nccl_ddp.horovod.tensorflow.tensors import Compression, dense

if TYPE_CHECKING:
    import keras


class _AggregationCount:
    """Horovod's `_agg_helper`: `counter`, the backward passes accumulated since the last update."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, steps: int) -> None:
        self._optimizer, self._steps = optimizer, steps

    @property
    def counter(self) -> tf.Tensor:
        # Keras counts every apply() in _iterations (`iterations` is the number of updates)
        return tf.math.floormod(tf.convert_to_tensor(self._optimizer._iterations), self._steps)


class _HorovodApply(_AllReduceBeforeApply):
    """Horovod's local variables, pre-reduced grads and aggregation scale on top of the reduction."""

    _hvd_local: List[Any]
    _hvd_scale_local: bool
    _hvd_passes_scale: float
    _hvd_reduced: bool
    _hvd_size: int

    def register_local_var(self, var: Any) -> None:
        """`var`'s grads stay this rank's (not reduced)."""
        self._hvd_local.append(var)

    def _is_local(self, var: Any) -> bool:
        return any(var is lo for lo in self._hvd_local)

    def _nccl_ddp_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        if self._hvd_reduced:  # _compute_gradients reduced them
            self._hvd_reduced = False
        else:
            grads = [None if g is None else dense(g, "DistributedOptimizer") for g in grads]
            shared = [i for i, v in enumerate(variables) if not self._is_local(v)]
            if self._hvd_size > 1:
                reduced = super()._nccl_ddp_reduce([grads[i] for i in shared], [variables[i] for i in shared])
                for i, g in zip(shared, reduced):
                    grads[i] = g
                if self._hvd_scale_local:
                    grads = [
                        g / self._hvd_size if g is not None and self._is_local(v) else g
                        for g, v in zip(grads, variables)
                    ]
        if self._hvd_passes_scale != 1.0:
            grads = [None if g is None else g * self._hvd_passes_scale for g in grads]
        return grads

    def _compute_gradients(
        self, loss: Union[tf.Tensor, Callable[[], tf.Tensor]], var_list: Sequence[Any], tape: Any = None
    ) -> List[Tuple[Any, Any]]:
        """Horovod's: the grads of `loss` (a tensor recorded on `tape`, or a callable) for
        `var_list`, reduced over the ranks, as (grad, variable) pairs."""
        var_list = list(var_list)
        if tape is None:
            if not callable(loss):
                raise ConfigTypeError("_compute_gradients: pass tape= with a loss tensor, or a callable loss")
            with tf.GradientTape() as tape:
                loss = loss()
        grads = self._nccl_ddp_reduce(list(tape.gradient(loss, var_list)), var_list)
        if self._hvd_passes_scale != 1.0:  # applied once more in apply()
            grads = [None if g is None else g / self._hvd_passes_scale for g in grads]
        self._hvd_reduced = True
        return list(zip(grads, var_list))

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("experimental_aggregate_gradients", None)  # Keras 2's flag; nothing to aggregate
        return super().apply_gradients(grads_and_vars, *args, **kwargs)  # type: ignore[misc]


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Optional[Sequence[Any]] = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Horovod's wrapper: the grads averaged (or summed) over the ranks in `apply()`."""
    import keras

    where = "DistributedOptimizer"
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigTypeError(
            f"{where}: {type(optimizer).__name__} is not a Keras 3 optimizer; TensorFlow 1 "
            "optimizers are not supported: use a keras.optimizers optimizer, or "
            "hvd.DistributedGradientTape around your tape"
        )
    op = resolve_op(op, None, where)
    check_grad_args(where, op, gradient_predivide_factor, compression)
    if num_groups or groups is not None:
        raise ConfigError(f"{where}: num_groups/groups are not supported: grads are fused into our buckets")
    passes = _check_passes(where, optimizer, backward_passes_per_step)
    group = process_set.group(where)
    config = {"gradient_accumulation_steps": passes} if passes > 1 else {}
    new = keras_optimizer(
        optimizer,
        mean=op == Average,
        compress="fp16" if compression is Compression.fp16 else None,
        group=None if process_set is global_process_set else group,
        mixin=_HorovodApply,
        config=config,
    )
    settings = {
        "_hvd_local": [],
        "_hvd_scale_local": scale_local_gradients,
        "_hvd_passes_scale": float(passes) if passes > 1 and not average_aggregated_gradients else 1.0,
        "_hvd_reduced": False,
        "_hvd_size": group.size,
        "_agg_helper": _AggregationCount(new, passes) if passes > 1 else None,
    }
    for k, v in settings.items():
        object.__setattr__(new, k, v)
    return new


def _check_passes(where: str, optimizer: keras.optimizers.Optimizer, passes: object) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"{where}: backward_passes_per_step must be an int >= 1, got {passes!r}")
    if passes > 1 and optimizer.gradient_accumulation_steps:
        raise ConfigError(
            f"{where}: backward_passes_per_step={passes} and the optimizer's "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} both accumulate; "
            "give one of them"
        )
    return passes


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Optional[Sequence[Any]] = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Optional[Sequence[keras.layers.Layer]] = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """A DistributedOptimizer whose `local_layers`' trainable weights are local variables."""
    import keras

    opt = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        0, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    if local_layers is None:
        layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        layers = [local_layers]
    else:
        layers = list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ConfigTypeError(
                f"PartialDistributedOptimizer: local_layers must be Keras layers, got {type(layer).__name__}"
            )
        for w in layer.trainable_weights:
            opt.register_local_var(w)
    return opt
