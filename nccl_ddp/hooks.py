"""Communication hooks for `DistributedDataParallel.register_comm_hook(state, hook)` (torch's
`ddp_comm_hooks`): `allreduce` (the default), `fp16_compress` and `bf16_compress` (half the bytes
on the wire; fused into the reducer's pack/unpack kernels), `powersgd` with its `PowerSGDState`
(low-rank, error feedback, warm start), and the pieces to write your own
(`GradBucket`, `Future`, `all_reduce_fut`). `state` is a process group or None (the DDP's group).
"""
from nccl_ddp.ddp.comm_hooks import (
    Future,
    GradBucket,
    all_reduce_fut,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from nccl_ddp.ddp.powersgd import PowerSGDState, powerSGD_hook

allreduce = allreduce_hook
fp16_compress = fp16_compress_hook
bf16_compress = bf16_compress_hook
powersgd = powerSGD_hook

__all__ = ["Future", "GradBucket", "PowerSGDState", "all_reduce_fut", "allreduce",
           "allreduce_hook", "bf16_compress", "bf16_compress_hook", "fp16_compress",
           "fp16_compress_hook", "powerSGD_hook", "powersgd"]
