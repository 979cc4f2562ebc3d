"""`import nccl_ddp.horovod.torch as hvd`: Horovod's torch API (horovod/torch/__init__.py's names)
on nccl_ddp. Collectives in `ops`, the optimizer in `optimizer`, broadcasts of model and
optimizer state in `functions`; ranks, process sets and handles are `nccl_ddp.horovod.common`'s."""

from nccl_ddp.horovod.common import *  # noqa: F403  (Horovod's basics)
from nccl_ddp.horovod.common import __all__ as _basics
from nccl_ddp.horovod.common import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from nccl_ddp.horovod.handles import poll, synchronize
from nccl_ddp.horovod.torch.exchange import *  # noqa: F403
from nccl_ddp.horovod.torch.exchange import __all__ as _exchange_names
from nccl_ddp.horovod.torch.functions import broadcast_optimizer_state, broadcast_parameters
from nccl_ddp.horovod.torch.ops import *  # noqa: F403
from nccl_ddp.horovod.torch.ops import __all__ as _ops_names
from nccl_ddp.horovod.torch.optimizer import DistributedOptimizer

__all__ = [
    *_basics,
    *_ops_names,
    *_exchange_names,
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "poll",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
