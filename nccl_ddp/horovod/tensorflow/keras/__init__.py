"""`import nccl_ddp.horovod.tensorflow.keras as hvd` (also `nccl_ddp.horovod.keras`): Horovod's
Keras API for Keras 3, on the TensorFlow facade and nccl_ddp's Keras adapter.

`DistributedOptimizer(opt)` is `nccl_ddp.keras.DistributedOptimizer`: an optimizer of `opt`'s
class whose `apply()` all-reduces the grads through our buckets before Keras clips and applies
them (Horovod hooked Keras 2's `get_gradients` / `_aggregate_gradients`, which Keras 3 optimizers
no longer have). Callbacks: `hvd.callbacks` (BroadcastGlobalVariablesCallback,
MetricAverageCallback, LearningRateWarmupCallback, LearningRateScheduleCallback).
"""

from __future__ import annotations

from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod.tensorflow.keras import callbacks  # noqa: F401
from nccl_ddp.horovod.tensorflow.ops import (  # noqa: F401  (Horovod's names, re-exported)
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    nccl_built,
    rank,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
)
from nccl_ddp.horovod.tensorflow.optimizer import DistributedOptimizer  # noqa: F401


def broadcast_global_variables(root_rank: int) -> None:
    raise ConfigError(
        "hvd.broadcast_global_variables is TensorFlow 1's (graph collections); use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
        "hvd.broadcast_variables(model.variables, root_rank)"
    )
