"""`import nccl_ddp.horovod.keras as hvd`: Horovod's `horovod.keras` names, for Keras 3 on
TensorFlow (the same as `nccl_ddp.horovod.tensorflow.keras`)."""

from nccl_ddp.horovod.tensorflow.keras import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.keras import (  # noqa: F401
    DistributedOptimizer,
    PartialDistributedOptimizer,
    broadcast_global_variables,
    callbacks,
)
