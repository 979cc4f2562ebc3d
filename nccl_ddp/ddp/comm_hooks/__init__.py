"""Communication hooks, in one home: the contract (`GradBucket`, `Future`, `all_reduce_fut`) and
torch's default hooks (default.py: allreduce, fp16/bf16 compression, which the reducer runs in its
fused kernels), PowerSGD (powersgd.py). Users import them from `nccl_ddp.hooks`; the reducer's
bucket submission reads the names below. torch's own hooks are translated in
adapters/torch/comm_hooks.py."""

from nccl_ddp.ddp.comm_hooks.default import (
    CommHook,
    Future,
    GradBucket,
    all_reduce_fut,
    allreduce_hook,
    bf16_compress_hook,
    builtin_compression,
    check_hook,
    compression_dtype,
    describe,
    fp16_compress_hook,
    is_builtin,
    resolve,
)
from nccl_ddp.ddp.comm_hooks.powersgd import PowerSGDState, powerSGD_hook

__all__ = [
    "CommHook",
    "Future",
    "GradBucket",
    "PowerSGDState",
    "all_reduce_fut",
    "allreduce_hook",
    "bf16_compress_hook",
    "builtin_compression",
    "check_hook",
    "compression_dtype",
    "describe",
    "fp16_compress_hook",
    "is_builtin",
    "powerSGD_hook",
    "resolve",
]
