"""Horovod's Keras `DistributedOptimizer` for Keras 3 (horovod/tensorflow/keras's signature), on
`nccl_ddp.keras.DistributedOptimizer`: an optimizer of the given one's class whose `apply()`
all-reduces the grads through our buckets before Keras clips and applies them (Horovod hooked
Keras 2's `get_gradients` / `_aggregate_gradients`, which Keras 3 optimizers no longer have)."""

from __future__ import annotations

from typing import Any, Optional

from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod.common import Average, Sum, resolve_op
from nccl_ddp.horovod.process_sets import global_process_set
from nccl_ddp.horovod.tensorflow.ops import Compression, _check_predivide


def DistributedOptimizer(
    optimizer: Any,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Horovod's wrapper: the grads averaged (or summed) over the ranks in `apply()`."""
    import keras

    from nccl_ddp.adapters.keras.adapter import DistributedOptimizer as keras_optimizer

    where = "DistributedOptimizer"
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigTypeError(
            f"{where}: {type(optimizer).__name__} is not a Keras 3 optimizer; TensorFlow 1 "
            "optimizers are not supported: use a keras.optimizers optimizer, or "
            "hvd.DistributedGradientTape around your tape"
        )
    op = resolve_op(op, None, where)
    if op not in (Average, Sum):
        raise ConfigError(f"{where}: op must be hvd.Average or hvd.Sum, got {op}")
    _check_predivide(where, op, gradient_predivide_factor)
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigError(f"{where}: compression must be hvd.Compression.none or hvd.Compression.fp16")
    if backward_passes_per_step != 1:
        raise ConfigError(
            f"{where}: backward_passes_per_step={backward_passes_per_step} is not supported with "
            "Keras 3: give the optimizer gradient_accumulation_steps=N (Keras accumulates the "
            "averaged grads and applies them every N steps)"
        )
    if num_groups or groups is not None:
        raise ConfigError(f"{where}: num_groups/groups are not supported: grads are fused into our buckets")
    group = process_set.group(where)
    return keras_optimizer(
        optimizer,
        mean=op == Average,
        compress="fp16" if compression is Compression.fp16 else None,
        group=None if process_set is global_process_set else group,
    )
