"""nccl_ddp: data-parallel gradient communication for any DLPack framework.

`import nccl_ddp` needs only NumPy; CuPy, NCCL and the frameworks load when first used.
"""

import importlib
from typing import Any

from nccl_ddp import errors, frameworks, hooks
from nccl_ddp.comm.api import (
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from nccl_ddp.comm.collectives import all_gather, all_reduce, barrier, broadcast, reduce_scatter
from nccl_ddp.comm.group import ProcessGroup, ReduceOp, Work
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.ddp.grad_reducer import DistributedGradReducer
from nccl_ddp.ddp.join import Join
from nccl_ddp.ddp.sharded_params import ShardedParams
from nccl_ddp.errors import NcclDdpError
from nccl_ddp.zero.config import ZeroConfig
from nccl_ddp.zero.optim import ShardAdamW, ShardSGD

__version__ = "0.1.0"


_SUBMODULES = ("accelerate", "keras", "lightning", "transformers")
"""The framework glue modules, loaded on first use (`nccl_ddp.lightning.NcclDDPStrategy()` after a
plain `import nccl_ddp`); each imports its framework only when one of its names is used."""


def __getattr__(name: str) -> Any:
    """`ZeroRedundancyOptimizer` (torch), `ZeroOptimizer` and `ShardOptax` (JAX + optax) load their framework
    only when first used; so do the glue modules (`nccl_ddp.lightning`, ...)."""
    if name == "ZeroRedundancyOptimizer":
        from nccl_ddp.adapters.torch.zero.optimizer import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    if name in ("fully_shard", "FSDPModule"):
        from nccl_ddp.adapters.torch.fsdp import api

        return getattr(api, name)
    if name == "register_fsdp_forward_method":
        from nccl_ddp.adapters.torch.fsdp.torch_methods import register_fsdp_forward_method

        return register_fsdp_forward_method
    if name in ("ZeroOptimizer", "ShardOptax"):
        from nccl_ddp.adapters.jax import zero

        return getattr(zero, name)
    if name in _SUBMODULES:
        return importlib.import_module(f"nccl_ddp.{name}")
    raise AttributeError(f"module 'nccl_ddp' has no attribute {name!r}")


__all__ = [
    "DistributedDataParallel",
    "DistributedGradReducer",
    "Join",
    "NcclDdpError",
    "ProcessGroup",
    "ReduceOp",
    "ShardAdamW",
    "ShardOptax",
    "ShardSGD",
    "ShardedParams",
    "Work",
    "ZeroConfig",
    "ZeroOptimizer",
    "ZeroRedundancyOptimizer",
    "__version__",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "errors",
    "FSDPModule",
    "fully_shard",
    "register_fsdp_forward_method",
    "frameworks",
    "hooks",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "reduce_scatter",
]
