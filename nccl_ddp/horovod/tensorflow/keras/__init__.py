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
from nccl_ddp.horovod.common import *  # noqa: F403  (Horovod's basics, re-exported)
from nccl_ddp.horovod.tensorflow.keras import callbacks  # noqa: F401
from nccl_ddp.horovod.tensorflow.ops import (  # noqa: F401  (Horovod's names, re-exported)
    Compression,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
    reducescatter,
)
from nccl_ddp.horovod.tensorflow.optimizer import DistributedOptimizer  # noqa: F401


def broadcast_global_variables(root_rank: int) -> None:
    raise ConfigError(
        "hvd.broadcast_global_variables is TensorFlow 1's (graph collections); use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
        "hvd.broadcast_variables(model.variables, root_rank)"
    )
