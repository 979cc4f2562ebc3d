"""The DDP core: the two wrappers (`DistributedDataParallel`, `DistributedGradReducer`), their
configs, and the reducer with its bucket layout and memory. Sharding (ZeRO) is `nccl_ddp.zero`."""

from nccl_ddp.ddp.config import DDPConfig, GradReducerConfig
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.ddp.grad_reducer import DistributedGradReducer

__all__ = ["DDPConfig", "DistributedDataParallel", "DistributedGradReducer", "GradReducerConfig"]
