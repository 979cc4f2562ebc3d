"""Process groups and collectives: `api` (the functional API), `host` and `nccl` backends."""
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
from nccl_ddp.comm.group import NonMemberGroup, ProcessGroup, ReduceOp, Work

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast", "destroy_process_group",
           "get_local_rank", "get_rank", "get_world_group", "get_world_size",
           "init_process_group", "is_initialized", "new_group", "reduce_scatter", "NonMemberGroup",
           "ProcessGroup",
           "ReduceOp", "Work"]
