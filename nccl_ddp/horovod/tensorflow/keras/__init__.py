"""`import nccl_ddp.horovod.tensorflow.keras as hvd` (also `nccl_ddp.horovod.keras`): Horovod's
Keras API for Keras 3, on the TensorFlow facade and nccl_ddp's Keras adapter.

`DistributedOptimizer(opt)` is `nccl_ddp.keras.DistributedOptimizer`: an optimizer of `opt`'s
class whose `apply()` all-reduces the grads through our buckets before Keras clips and applies
them (Horovod hooked Keras 2's `get_gradients` / `_aggregate_gradients`, which Keras 3 optimizers
no longer have). Callbacks: `hvd.callbacks` (BroadcastGlobalVariablesCallback,
MetricAverageCallback, LearningRateWarmupCallback, LearningRateScheduleCallback).
"""

from __future__ import annotations

from nccl_ddp.horovod.common import *  # noqa: F403  (Horovod's basics, re-exported)
from nccl_ddp.horovod.tensorflow import (  # noqa: F401  (Horovod's names, re-exported)
    Compression,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from nccl_ddp.horovod.tensorflow.keras import callbacks  # noqa: F401
from nccl_ddp.horovod.tensorflow.optimizer import (  # noqa: F401
    DistributedOptimizer,
    PartialDistributedOptimizer,
)
