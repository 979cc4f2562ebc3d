"""ZeRO-2's bucket collective: each bucket is reduce-scattered into this rank's shard of it.

The reducer's submission path (bucket_submit.py) calls it in place of the all-reduce, in
comm-stream order while backward goes on. It averages in the collective, and only the owned slice
of the reduced grad is kept (`outputs[b]`, `shard_numel[b]` elements in the bucket's dtype, or in
`reduce_dtype` when one is asked: a bf16/fp16 bucket is then widened into one scratch buffer,
reused by every bucket in comm-stream order, and reduced there). The buckets it reads are either
full-size buffers kept by their owner, or a `GradPool`'s, reused bucket after bucket (the torch
DDP wrapper and the JAX/array forms: no full-size grad buffer outlives the step). `accumulate`:
the step adds its reduced grads to the shards instead of replacing them (a backward without
`zero_grad()` after a synchronised one: the local grads of the last step are gone, their
reduced shards are what is kept).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Union

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import BucketLayout
from nccl_ddp.buckets.memory import BucketBuffers
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.device import Device
from nccl_ddp.errors import ConfigError, ReducerError
from nccl_ddp.zero.layout import ShardLayout


class ReduceScatter:
    """`BucketCollective` reducing bucket b's buffer into `outputs[b]` (rank r's chunk)."""

    phase = "reducescatter"

    def __init__(
        self,
        group: ProcessGroup,
        device: Device,
        shards: ShardLayout,
        memory: Optional[Union[BucketBuffers, GradPool]],
        reduce_dtype: Optional[np.dtype] = None,
    ) -> None:
        if memory is not None and memory.layout != shards.layout:
            raise ConfigError(f"rank {group.rank}: bucket memory is not laid out for the shards")
        self.group, self.device, self.shards = group, device, shards
        self.reduce_dtype = reduce_dtype
        wire = [
            np.dtype(b.dtype) if reduce_dtype is None else np.dtype(reduce_dtype)
            for b in shards.layout.buckets
        ]
        self.outputs: List[Any] = [device.zeros(s, w) for s, w in zip(shards.shard_numel, wire)]
        # a GradPool: the submitter packs into its buffers (zeroed first); None: the caller hands
        # each bucket's buffer to reduce(b, ...)
        self.pool = memory if isinstance(memory, GradPool) else None
        self._index = {} if memory is None else {id(buf): b for b, buf in enumerate(memory.buffers)}
        widened = [b.padded for b, w in zip(shards.layout.buckets, wire) if np.dtype(b.dtype) != w]
        self._scratch = device.zeros(max(widened), reduce_dtype) if widened else None
        self.accumulate = False  # set per step by the owner, before its first bucket launches

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None:
        b = self._index.get(id(buf))
        if b is None:
            raise ReducerError(
                f"rank {self.group.rank}: {tag} is not one of the sharded "
                "buckets (a comm hook or Join cannot reduce-scatter)"
            )
        self.reduce(b, buf, op, tag)

    def reduce(self, b: int, buf: Any, op: ReduceOp, tag: str) -> None:
        """Reduce-scatter `buf` (bucket b's flat grads) into `outputs[b]`, in stream order."""
        out = self.outputs[b]
        if np.dtype(buf.dtype) != np.dtype(out.dtype):  # widen into the scratch (stream order)
            assert self._scratch is not None
            wide = self._scratch[: buf.size]
            wide[...] = buf.astype(out.dtype, copy=False)
            buf = wide
        dst = self.device.zeros(out.size, out.dtype) if self.accumulate else out
        self.group.reduce_scatter(dst, buf, op, stream=self.device.current_stream(), tag=tag).wait(
            self.group.timeout
        )
        if dst is not out:  # (stream order: the comm stream is current)
            out += dst


class GradPool:
    """Stage 2's grad buckets when nothing keeps them across the step (torch's DDP, JAX, arrays): one flat
    buffer per dtype, as large as the largest bucket of that dtype, reused bucket after bucket in
    stream order (pack, reduce-scatter, next bucket) instead of one full-size buffer per bucket:
    the reduced grads then exist only as this rank's shards."""

    def __init__(
        self, layout: BucketLayout, device: Device, zeros: Optional[Callable[[int, Any], Any]] = None
    ) -> None:
        self.layout = layout
        sizes: dict = {}
        for b in layout.buckets:
            dt = np.dtype(b.dtype)
            sizes[dt] = max(sizes.get(dt, 0), b.padded)
        alloc = zeros or device.zeros  # the group's: shared on the host's shm (peers read in place)
        self._flat = {dt: alloc(n, dt) for dt, n in sizes.items()}
        self.buffers = [self._flat[np.dtype(b.dtype)][: b.padded] for b in layout.buckets]
        """Bucket b's buffer, not zeroed (the same object every time: ReduceScatter's index)."""

    @property
    def nbytes(self) -> int:
        return sum(int(f.nbytes) for f in self._flat.values())

    def buffer(self, b: int) -> Any:
        """Bucket b's buffer, cleared now (`clear`), as the pack that follows runs (on CuPy: the
        current stream)."""
        self.clear(b)
        return self.buffers[b]

    def clear(self, b: int) -> None:
        """Zero bucket b's gaps and padding, which belong to no parameter (a previous bucket's
        values there would reach the norm); the pack writes every parameter's range. On the host
        only the gaps (one pass over the bucket less); on a GPU the whole buffer, in one kernel."""
        view = self.buffers[b]
        if not isinstance(view, np.ndarray):
            kernels.zero_(view)
            return
        bucket = self.layout.buckets[b]
        end = 0
        for o, n in zip(bucket.offsets, bucket.numels):
            if o > end:
                view[end:o] = 0
            end = max(end, o + n)
        view[end:] = 0


def refuse_unshardable(rank: int, per_grad: bool, static_graph: bool, comm_hook: Any) -> None:
    """ZeRO-2 needs flat buckets fixed from the start and reduced by the collective itself
    (`per_grad`: the reducer runs one collective per grad, reducer_mode="PythonReducer")."""
    why = None
    if per_grad:
        why = "reducer_mode='PythonReducer' reduces grad by grad, without buckets to shard"
    elif static_graph:
        why = (
            "static_graph=True drops parameters unused in the first step from the buckets "
            "after it, which would move every shard"
        )
    elif comm_hook is not None:
        name = getattr(comm_hook[1], "__name__", comm_hook[1])
        why = f"the registered comm hook {name!r} reduces whole buckets"
    if why is not None:
        raise ConfigError(
            f"rank {rank}: DistributedDataParallel(zero=ZeroConfig(stage=2)) cannot shard this "
            f"model: {why}. Drop that option, or shard only the optimizer (ZeRO-1: build the "
            "model without zero= or with ZeroConfig(stage=1); the optimizer follows it)"
        )
