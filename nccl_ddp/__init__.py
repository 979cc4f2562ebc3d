"""nccl_ddp: data-parallel gradient communication for any DLPack framework.

`import nccl_ddp` needs only NumPy; CuPy, NCCL and the frameworks load when first used.
"""
from nccl_ddp import errors, hooks
from nccl_ddp.comm.api import (
                               all_gather,
                               all_reduce,
                               barrier,
                               broadcast,
                               destroy_process_group,
                               get_local_rank,
                               get_rank,
                               get_world_group,
                               get_world_size,
                               init_process_group,
                               is_initialized,
                               new_group,
                               reduce_scatter,
)
from nccl_ddp.comm.group import ProcessGroup, ReduceOp, Work
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.ddp.grad_reducer import DistributedGradReducer
from nccl_ddp.ddp.join import Join
from nccl_ddp.errors import NcclDdpError

__version__ = "0.1.0"

__all__ = ["DistributedDataParallel", "DistributedGradReducer", "Join", "NcclDdpError", "ProcessGroup",
           "ReduceOp", "Work", "__version__", "all_gather", "all_reduce", "barrier", "broadcast",
           "destroy_process_group", "errors", "hooks", "get_local_rank", "get_rank", "get_world_group",
           "get_world_size", "init_process_group", "is_initialized", "new_group", "reduce_scatter"]
