"""The one factory of the shard core: from a validated `ZeroConfig`, the parameters and the group,
`build_core` cuts the shards (zero/layout.py), wires the reduce-scatter (stage 2, zero/reduce_scatter.py)
and builds the shard memory (zero/shards.py). Every form uses it:

- our `DistributedDataParallel(module, zero=ZeroConfig(...))`: its reducer builds the core at
  construction over its own bucket layout (`shards=`), on its comm stream; under stage 2 it packs
  each bucket's grads into the core's `GradPool` (torch: the framework's own `p.grad`s, dropped
  after the step) or, for a framework whose grads must stay in buckets, hands its full-size
  buckets (`grad_memory=`); the torch `ZeroRedundancyOptimizer` then only steps it;
- the torch `ZeroRedundancyOptimizer` over parameters of any other model (ZeRO-1);
- JAX's `ZeroOptimizer` and the array form: stage 2 reduce-scatters from a `GradPool`, one
  bucket-sized buffer per dtype reused bucket after bucket, so no full-size grad copy is kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional

from nccl_ddp.buckets.layout import BucketLayout, ParamSpec, assign_buckets
from nccl_ddp.buckets.memory import BucketBuffers
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.device import Device, Stream
from nccl_ddp.profiling import Timeline
from nccl_ddp.zero.config import ZeroConfig
from nccl_ddp.zero.layout import ShardLayout, shard_layout
from nccl_ddp.zero.reduce_scatter import GradPool, ReduceScatter
from nccl_ddp.zero.shards import ZeroShards


@dataclasses.dataclass
class ShardCore:
    """What one sharded model (or optimizer) holds. `reduce`: the bucket collective of stage 2
    (its `outputs` are the reduced grad shards), None under stage 1; `grad_memory`: the
    reducer's full-size grad buckets it reduces, or None (then `pool`)."""

    config: ZeroConfig
    shards: ShardLayout
    shard_memory: ZeroShards
    reduce: Optional[ReduceScatter]
    grad_memory: Optional[BucketBuffers]
    group: ProcessGroup
    pool: Optional[GradPool] = None
    """Stage 2 without a reducer's buckets: the bucket buffers, reused (`pool.buffer(b)`)."""

    @property
    def stage(self) -> int:
        return self.config.stage

    def close(self) -> None:
        self.shard_memory.close()


def build_core(
    config: ZeroConfig,
    params: List[Any],
    group: ProcessGroup,
    device: Device,
    *,
    shards: Optional[ShardLayout] = None,
    grad_memory: Optional[BucketBuffers] = None,
    install: Optional[Callable[[int, Any], None]] = None,
    comm: Optional[Stream] = None,
    timeline: Optional[Callable[[], Timeline]] = None,
    fp32_grad_shards: bool = True,
) -> ShardCore:
    """The shard core over `params` (native arrays). `shards`: the cut (`plan`; None: one made
    here with the config's bucket cap); `grad_memory`: stage 2's grad buckets laid out as the
    shards (None: a `GradPool`, one bucket-sized buffer per dtype); `install(i, view)`: parameter
    i aliases `view` from now on (None: gathered values are copied back into `params`); `comm`:
    the stream the all-gathers run on (None: the core's own); `timeline()`: where they are timed;
    `fp32_grad_shards=False`: stage 1 keeps no fp32 grad shard for fp32 buckets (the caller reads
    the full reduced grads as views, see ZeroShards)."""
    if shards is None:
        specs = [ParamSpec(tuple(p.shape), p.dtype) for p in params]
        base = assign_buckets(specs, config.cap_bytes, config.first_cap_bytes, align_bytes=device.align_bytes)
        shards = plan(base, group, device)
    reduce, pool = None, None
    if config.stage == 2:
        if grad_memory is None:  # no full-size grad buckets: a pool reused bucket after bucket
            pool = GradPool(shards.layout, device, functools.partial(group.zeros, device))
        memory = pool if grad_memory is None else grad_memory
        reduce = ReduceScatter(group, device, shards, memory, config.reduce_dtype)
    shard_memory = ZeroShards(
        shards,
        params,
        group,
        device,
        install=install,
        comm=comm,
        shard_grads=None if reduce is None else reduce.outputs,
        timeline=timeline,
        fp32_grad_shards=fp32_grad_shards,
    )
    return ShardCore(config, shards, shard_memory, reduce, grad_memory, group, pool)


def plan(layout: BucketLayout, group: ProcessGroup, device: Device) -> ShardLayout:
    """`layout` padded so every bucket cuts into `group.size` equal aligned shards (a reducer
    lays its grad buckets out by `plan(...).layout` before the core is built over them)."""
    return shard_layout(layout, group.size, device.align_bytes)
