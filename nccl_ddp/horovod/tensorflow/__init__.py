"""`import nccl_ddp.horovod.tensorflow as hvd`: Horovod's TensorFlow 2 API (horovod/tensorflow's
names) on nccl_ddp.

Collectives take and return tensors, eagerly, inside `tf.function` or in a TensorFlow 1 graph
(host_call.py), with Horovod's gradients and `tf.errors` types: the reducing ones in `ops`, the
data-moving ones in `movement`. `DistributedGradientTape` (`tape`) reduces the tape's grads
through `nccl_ddp.DistributedGradReducer`; `DistributedOptimizer` takes Keras 3 optimizers.
Keras: `nccl_ddp.horovod.tensorflow.keras`.
"""

from nccl_ddp.horovod.common import *  # noqa: F403
from nccl_ddp.horovod.common import __all__ as _basics
from nccl_ddp.horovod.common import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rocm_built,
)
from nccl_ddp.horovod.tensorflow import util
from nccl_ddp.horovod.tensorflow.basics import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.basics import __all__ as _basic_ops
from nccl_ddp.horovod.tensorflow.movement import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.movement import __all__ as _moving
from nccl_ddp.horovod.tensorflow.ops import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.ops import __all__ as _reducing
from nccl_ddp.horovod.tensorflow.optimizer import DistributedOptimizer
from nccl_ddp.horovod.tensorflow.tape import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.tape import __all__ as _tapes
from nccl_ddp.horovod.tensorflow.util import _executing_eagerly  # noqa: F401  (Horovod's name)

__all__ = [
    *_basics,
    *_basic_ops,
    *_moving,
    *_reducing,
    *_tapes,
    "DistributedOptimizer",
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "rocm_built",
    "util",
]
