"""ZeRO-2's bucket collective: each bucket is reduce-scattered into this rank's shard of it.

The reducer's submission path (bucket_submit.py) calls it in place of the all-reduce, in
comm-stream order while backward goes on. It averages in the collective, so the bucket itself
(the framework's `.grad` views) keeps this rank's local grads: accumulation across `no_sync()`
steps and without `zero_grad()` stays what an all-reduce DDP gives, and only the owned slice of
the reduced grad is kept (`outputs[b]`, `shard_numel[b]` elements in the bucket's dtype).
"""

from __future__ import annotations

from typing import Any, List

from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp.bucket_memory import BucketBuffers
from nccl_ddp.ddp.shard_layout import ShardLayout
from nccl_ddp.errors import ConfigError, ReducerError


class ReduceScatter:
    """`BucketCollective` reducing bucket b's buffer into `outputs[b]` (rank r's chunk)."""

    phase = "reducescatter"

    def __init__(self, group: ProcessGroup, device: Any, shards: ShardLayout, memory: BucketBuffers) -> None:
        if memory.layout != shards.layout:
            raise ConfigError(f"rank {group.rank}: bucket memory is not laid out for the shards")
        self.group, self.device, self.shards = group, device, shards
        self.outputs: List[Any] = [
            device.zeros(s, b.dtype) for s, b in zip(shards.shard_numel, shards.layout.buckets)
        ]
        self._index = {id(buf): b for b, buf in enumerate(memory.buffers)}

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None:
        b = self._index.get(id(buf))
        if b is None:
            raise ReducerError(
                f"rank {self.group.rank}: {tag} is not one of the sharded "
                "buckets (a comm hook or Join cannot reduce-scatter)"
            )
        self.group.reduce_scatter(
            self.outputs[b], buf, op, stream=self.device.current_stream(), tag=tag
        ).wait(self.group.timeout)


def refuse_unshardable(rank: int, reducer_mode: str, static_graph: bool, hook: Any) -> None:
    """ZeRO-2 needs flat buckets fixed from the start and reduced by the collective itself."""
    why = None
    if reducer_mode == "PythonReducer":
        why = "reducer_mode='PythonReducer' reduces grad by grad, without buckets to shard"
    elif static_graph:
        why = (
            "static_graph=True drops parameters unused in the first step from the buckets "
            "after it, which would move every shard"
        )
    elif hook is not None:
        why = f"the registered comm hook {getattr(hook[1], '__name__', hook[1])!r} reduces whole buckets"
    if why is not None:
        raise ConfigError(
            f"rank {rank}: a sharded optimizer (ZeRO-2) cannot shard this DistributedDataParallel: "
            f"{why}. Build the wrapper without it, or shard only the optimizer (ZeRO-1: "
            "torch's DDP, or zero_stage=1 on a model not wrapped by nccl_ddp)"
        )
