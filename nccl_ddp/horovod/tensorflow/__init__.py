"""`import nccl_ddp.horovod.tensorflow as hvd`: Horovod's TensorFlow 2 API (horovod/tensorflow's
names) on nccl_ddp.

Collectives take and return tensors, eagerly or inside `tf.function` (there, one stateful
`tf.numpy_function` per call: ordered, never pruned; XLA cannot call back). `DistributedGradientTape`
reduces the tape's grads through `nccl_ddp.DistributedGradReducer` (our buckets and the TensorFlow
adapter; fp16 compression fused); `DistributedOptimizer` takes Keras 3 optimizers. Keras:
`nccl_ddp.horovod.tensorflow.keras`. Implementation: `ops` and `optimizer`.
"""

from nccl_ddp.horovod.common import *  # noqa: F403
from nccl_ddp.horovod.common import __all__ as _basics
from nccl_ddp.horovod.tensorflow.ops import *  # noqa: F403
from nccl_ddp.horovod.tensorflow.ops import __all__ as _ops_names
from nccl_ddp.horovod.tensorflow.optimizer import DistributedOptimizer

__all__ = [*_basics, *_ops_names, "DistributedOptimizer"]
