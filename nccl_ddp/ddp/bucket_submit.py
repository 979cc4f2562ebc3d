"""Bucket submission: how one bucket's grads reach the collective, queued on the comm stream.

The reducer decides *when* a bucket goes (readiness, launch order); this module decides *how*:
`BucketSubmitter.plan` picks the bucket's path and its planner (bucket_plan.py) lists the steps,
which `submit` queues on the comm stream in one loop. The paths:

- "per_grad" (reducer_mode="PythonReducer"): one collective per grad, each scaled by 1/world
  first (no fused kernels).
- "view" (grads are views of the bucket): scale the bucket in place (unless AVG), reduce it; on a
  group that fuses the two (`ProcessGroup.fuses_premul_sum`: the host backend), one pre-multiplied
  sum.
- "pack" (grads live elsewhere): one fused pack with the scale, reduce, one unpack.
- `HookPath.COMPRESSED` (either of the two, a built-in fp16/bf16 hook on a float32 bucket): pack into
  a buffer of the compression dtype with the scale, reduce that, unpack widened back.
- `HookPath.HOOK` (any other registered hook): the hook on the unscaled bucket; its result copied back.

The collective is a choice (`BucketCollective`): every path reduces its flat buffer through it.
Today's is `AllReduce`; a sharded optimizer's reduce-scatter into the rank's slice is one more.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.buckets.layout import Bucket, BucketLayout, ParamSpec, bucket_tag
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.ddp.bucket_plan import (
    BucketCollective,
    BucketWork,
    HookCall,
    Plan,
    Step,
    param_views,
    plan_comm_hook,
    plan_compressed,
    plan_compressed_fused,
    plan_pack,
    plan_per_grad,
    plan_premul_view,
    plan_view,
)
from nccl_ddp.device import Device, Stream
from nccl_ddp.profiling import Timeline

Mode = Literal["per_grad", "view", "pack"]
"""How a bucket's grads relate to its buffer (see the module doc)."""


class HookPath(enum.Enum):
    """Which path a bucket takes given the registered comm hook (if any)."""

    OWN = "own"
    """The fused default: the bucket is reduced in its own dtype (no hook, `allreduce_hook`, or a
    compression hook on a bucket already in the compression dtype)."""
    COMPRESSED = "compressed"
    """A built-in fp16/bf16 hook on a float32 bucket, fused into the pack/unpack kernels."""
    HOOK = "hook"
    """The hook itself is called on the bucket (a user hook, a state other than the group, or a
    compression hook on a bucket it cannot fuse)."""


class AllReduce:
    """The whole buffer, reduced in place on every rank.

    The second hop of a gradient is here: a comm-stream step hands its buffer to the group,
    ordered on the current (comm) stream. On CUDA, NCCL's kernel is queued on the comm stream
    and this thread goes on; on the host, the collective runs on this (the comm stream's)
    thread when the group's own worker is idle, else on that worker while the stream waits
    (`HostProcessGroup._submit`):

        comm stream : ─[pack]─ all_reduce(stream=comm) ─ wait(done) ────────────── [unpack] ─
        group worker:                      ╲ (busy: queued) ─ [collective] ─●done ╱
    """

    phase = "allreduce"

    def __init__(self, group: ProcessGroup, device: Device) -> None:
        self.group, self.device = group, device

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None:
        all_reduce_here(self.group, self.device, buf, op, tag)

    @property
    def fuses_scale(self) -> bool:
        """The group scales and sums in one pass on this device (the group's answer)."""
        return self.group.fuses_premul_sum(self.device)

    def fuses_compression(self, compression: str) -> bool:
        """The group gives a compression hook's bits on the float32 bucket itself (its answer)."""
        return self.group.fuses_compression(self.device, compression)

    def compressed_sum(self, buf: Any, scale: float, compression: str, tag: str) -> None:
        """float32 buf = its pack into `compression` with `scale`, all-reduced, widened back, in
        stream order (`ProcessGroup.all_reduce_compressed`)."""
        group = self.group
        work = group.all_reduce_compressed(
            buf, scale, compression, stream=self.device.current_stream(), tag=tag
        )
        work.wait(group.timeout)

    def premul_sum(self, buf: Any, scale: float, tag: str) -> None:
        """buf = the sum over ranks of scale * buf, in stream order (see `all_reduce_here`)."""
        group = self.group
        group.all_reduce_premul_sum(buf, scale, stream=self.device.current_stream(), tag=tag).wait(
            group.timeout
        )


def all_reduce_here(group: ProcessGroup, device: Device, buf: Any, op: ReduceOp, tag: str) -> None:
    """An all-reduce run in stream order: cuda enqueues it on the current (comm) stream without
    blocking; host runs it on this thread, or on the group's worker while this stream waits
    when that one is busy (`AllReduce` draws the hand-off). `tag` names the buffer in errors
    ("bucket 3 (1.0 MiB)")."""
    group.all_reduce(buf, op, stream=device.current_stream(), tag=tag).wait(group.timeout)


class BucketSubmitter:
    """Queues buckets' pack / collective / unpack (or hook) on `comm`, timed by `prof`.

    `hook`: the registered (state, hook) or None. `label(i)` names parameter i in errors."""

    def __init__(
        self,
        group: ProcessGroup,
        device: Device,
        comm: Stream,
        *,
        specs: Sequence[ParamSpec],
        params: Sequence[Any],
        average_in_collective: bool,
        label: Callable[[int], str],
        collective: Optional[BucketCollective] = None,
    ) -> None:
        self.group, self.device, self.comm = group, device, comm
        self.label = label
        self.average_in_collective = average_in_collective
        self.collective: BucketCollective = AllReduce(group, device) if collective is None else collective
        # a GradPool (ZeRO-2 over grads handed in per step): "pack" mode's buffers, zeroed first
        self.pool = getattr(self.collective, "pool", None)
        self.prof = Timeline(group.rank)  # NVTX ranges / per-step timeline when switched on
        self.comm_hook: Optional[Tuple[Any, comm_hooks.CommHook]] = None
        self._hook_call = HookCall(group, specs, params)
        self._compressed_buffers: Dict[Tuple[BucketLayout, int], Any] = {}

    def scale_and_op(self, divisor: Optional[int] = None) -> Tuple[float, ReduceOp]:
        """(pack scale, reduce op) of a step that divides by `divisor` ranks (None: the group)."""
        world = self.group.size
        divisor = world if divisor is None else divisor
        if self.average_in_collective and divisor == world:
            return 1.0, ReduceOp.AVG
        return 1.0 / divisor, ReduceOp.SUM

    def hook_path(self, bucket: Bucket) -> Tuple[HookPath, str]:
        """Which path the registered comm hook gives `bucket`, and the compression dtype's name
        when that is `HookPath.COMPRESSED` (else "")."""
        if self.comm_hook is None:
            return HookPath.OWN, ""
        state, hook = self.comm_hook
        if not comm_hooks.is_builtin(hook) or state not in (None, self.group):
            return HookPath.HOOK, ""
        compression = comm_hooks.builtin_compression(hook)
        if compression is None or np.dtype(bucket.dtype).name == compression:
            return HookPath.OWN, ""
        if np.dtype(bucket.dtype) == np.float32:
            return HookPath.COMPRESSED, compression
        return HookPath.HOOK, ""

    def submit_zeros(self, layout: BucketLayout, per_grad: bool, flags: Any, divisor: Optional[int]) -> None:
        """Every bucket of `layout` on zeros, in order (a joined rank's stand-in for the others'
        step); `flags`: the step's non-finite flags or None."""
        for b, bucket in enumerate(layout.buckets):
            buf = self.device.zeros(bucket.padded, bucket.dtype)
            grads = param_views(bucket, buf)
            flag = None if flags is None else flags[b : b + 1]
            self.submit(layout, b, "per_grad" if per_grad else "view", grads, buf, flag, divisor)

    def submit(
        self,
        layout: BucketLayout,
        b: int,
        mode: Mode,
        grads: List[Any],
        buf: Any,
        flag: Any,
        divisor: Optional[int] = None,
    ) -> None:
        """Queue bucket b of `layout` on the comm stream: its plan (`plan`), step by step.
        `grads`: the bucket's grads (unused in "view" mode, where they are views of `buf`);
        `buf`: its buffer (None in "per_grad" mode); a Join shadow passes zeros. `flag`: the
        bucket's non-finite flag or None. `divisor`: the ranks the step divides by (None: the
        group).

        The first thread hop of a gradient is in the loop below. This runs on the thread that
        marked the bucket's last grad ready (the framework's autograd thread, in its hook); each
        step goes to the comm stream: on the host, its worker thread runs it later (inline only
        inside an idle `awaited()`, the step's end); on CUDA, this thread queues its kernels on
        the comm stream.

            hook thread: ─ start_bucket(b) ─ submit: step 1 ─ step 2 ─ step 3 ─ backward goes on ─▶
                                                      ╲        ╲        ╲
            comm stream: ── wait(ready) ──────────── [step 1] [step 2] [step 3] ─●record(done)
        """
        bucket = layout.buckets[b]
        scale, op = self.scale_and_op(divisor)
        work = BucketWork(bucket, grads, buf, flag, scale, op, bucket_tag(b, bucket.nbytes))
        for step in self.plan(layout, b, mode, work, divisor):
            self.prof.submit(self.comm, step.phase, b, step.nbytes, step.fn, *step.args, dtype=step.dtype)

    def plan(
        self, layout: BucketLayout, b: int, mode: Mode, work: BucketWork, divisor: Optional[int]
    ) -> Plan:
        """The steps that reduce bucket b of `layout` (`work`: its grads, buffer, flag, scale and
        op), by path: the planner of bucket_plan.py that fits its mode and the comm hook."""
        bucket, collective = work.bucket, self.collective
        if mode == "per_grad":
            tags = [f"grad {self.label(p)} of {work.tag}" for p in bucket.params]
            return plan_per_grad(work, collective, tags)
        path, compression = self.hook_path(bucket)
        if path is HookPath.HOOK and self.comm_hook is not None:
            state, hook = self.comm_hook
            args = (layout, b, mode, work.grads, work.buf, work.flag, state, hook)
            return plan_comm_hook(work, self._hook_call.run_comm_hook, args)
        first: Plan = []
        if mode == "pack" and self.pool is not None:  # zeroed in stream order, after its last reader
            work = dataclasses.replace(work, buf=self.pool.buffers[b])
            first = [Step("pack", bucket.nbytes, self.pool.clear, (b,))]
        if path is HookPath.COMPRESSED:  # the hook's contract: scaled by 1/world, then summed
            work = dataclasses.replace(work, scale=1.0 / (divisor or self.group.size), op=ReduceOp.SUM)
            if mode == "view" and work.flag is None and isinstance(collective, AllReduce):
                if collective.fuses_compression(compression):
                    return plan_compressed_fused(
                        work, collective.phase, collective.compressed_sum, compression
                    )
            wire = self._compressed_buffer(layout, b, compression)
            return first + plan_compressed(work, mode == "view", wire, compression, collective)
        if mode == "pack":
            return first + plan_pack(work, collective)
        if work.flag is None and work.scale != 1.0:  # a scale that the group may fuse (no flag pass)
            if isinstance(collective, AllReduce) and collective.fuses_scale:
                return plan_premul_view(work, collective.phase, collective.premul_sum)
        return plan_view(work, collective)

    def _compressed_buffer(self, layout: BucketLayout, b: int, compression: str) -> Any:
        """Bucket b's buffer in the compression dtype (allocated once per layout), from the
        group (on the host's shm transport, memory the peers reduce in place)."""
        key = (layout, b)
        buf = self._compressed_buffers.get(key)
        if buf is None:
            self._compressed_buffers = {k: v for k, v in self._compressed_buffers.items() if k[0] is layout}
            buf = self._compressed_buffers[key] = self.group.zeros(
                self.device, layout.buckets[b].padded, comm_hooks.compression_dtype(compression)
            )
        return buf
