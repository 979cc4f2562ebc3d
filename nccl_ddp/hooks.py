"""Communication hooks for `DistributedDataParallel.register_comm_hook(state, hook)` (torch's
`ddp_comm_hooks`): `allreduce` (the default), `fp16_compress` and `bf16_compress` (half the bytes
on the wire; fused into the reducer's pack/unpack kernels), `powersgd` with its `PowerSGDState`
(low-rank, error feedback, warm start), and the pieces to write your own
(`GradBucket`, `Future`, `all_reduce_fut`). `state` is a process group or None (the DDP's group).
The public face of `nccl_ddp.ddp.comm_hooks`, where they live.
"""

from nccl_ddp.ddp.comm_hooks import Future, GradBucket, PowerSGDState, all_reduce_fut
from nccl_ddp.ddp.comm_hooks import allreduce_hook as allreduce
from nccl_ddp.ddp.comm_hooks import bf16_compress_hook as bf16_compress
from nccl_ddp.ddp.comm_hooks import fp16_compress_hook as fp16_compress
from nccl_ddp.ddp.comm_hooks import powerSGD_hook as powersgd

__all__ = [
    "Future",
    "GradBucket",
    "PowerSGDState",
    "all_reduce_fut",
    "allreduce",
    "bf16_compress",
    "fp16_compress",
    "powersgd",
]
