"""Sharding (ZeRO-1/2): which slice of each flat bucket a rank owns (layout), the reduce-scatter
(grads), the shard memory, norm and parameter all-gather (shards), the fused flat-shard
optimizers (optim) and checkpoint consolidation/resharding (checkpoint). It sits beside `ddp/` at
the wrapper/core level: the reducer builds its reduce-scatter from here."""

from nccl_ddp.zero.optim import ShardAdamW, ShardSGD

__all__ = ["ShardAdamW", "ShardSGD"]
