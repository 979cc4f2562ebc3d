"""Bucket plans: the steps that reduce one bucket, one small planner per path.

A plan is a list of `Step`s (a timeline phase, the bytes it moves, a callable and its arguments)
that `BucketSubmitter.submit` hands to the comm stream in order, through the timeline, in one
loop. A planner only builds the list: nothing runs and nothing is allocated here (the submitter
hands it the buffers). Which path a bucket takes is the submitter's choice (bucket_submit.py):

- `plan_per_grad` (PythonReducer): per grad, its scale by 1/world, its own collective.
- `plan_view` (grads are views of the bucket): scale the bucket in place (none under AVG), reduce.
- `plan_premul_view`: the same where the group scales as it sums: one pre-multiplied sum.
- `plan_pack` (grads live elsewhere): one fused pack with the scale, reduce, one unpack.
- `plan_compressed` (a built-in fp16/bf16 hook on a float32 bucket): pack into the wire dtype with
  the scale, reduce that, unpack widened back.
- `plan_compressed_fused`: the same bits in one step where the group rounds as it sums (fp16 on
  the host's shared memory: no wire buffer, no casts).
- `plan_comm_hook` (any other registered hook): the hook on the unscaled bucket (`HookCall`).

With check_finite's flag the scale (or a pass of its own) and the unpack raise the bucket's flag.
This is Megatron's `start_grad_sync` and torch's `Reducer::all_reduce_bucket`, written as data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import Bucket, BucketLayout, ParamSpec, bucket_tag
from nccl_ddp.buckets.memory import copy_into
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.errors import CommHookError


class BucketCollective(Protocol):
    """Reduces a bucket's flat buffer across the group, run in comm-stream order (a submitted
    task, so the current stream is the comm stream). `phase`: its name on the timeline."""

    phase: str

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Step:
    """One piece of a bucket's work on the comm stream: `fn(*args)`, timed as `phase`."""

    phase: str  # "pack", the collective's phase, "unpack" or "hook"
    nbytes: int  # what it moves (the timeline's bytes)
    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    dtype: str = ""  # the wire dtype, where it is not the bucket's (compression)


Plan = List[Step]


@dataclasses.dataclass(frozen=True)
class BucketWork:
    """What a planner plans over: `bucket`, its grads (unused where they are views of `buf`),
    its flat buffer (None in PythonReducer), check_finite's flag (or None), the step's scale and
    reduce op, and its name in errors ("bucket 3 (1.0 MiB)")."""

    bucket: Bucket
    grads: List[Any]
    buf: Any
    flag: Any
    scale: float
    op: ReduceOp
    tag: str


def plan_per_grad(w: BucketWork, collective: BucketCollective, tags: Sequence[str]) -> Plan:
    """PythonReducer: per grad (`tags[k]` names grad k), its scale (through the pack kernel
    where a flag is raised), its collective, and the check of what the reduction handed back (an
    overflowing sum)."""
    plan: Plan = []
    for g, tag in zip(w.grads, tags):
        if w.scale != 1.0 or w.flag is not None:
            plan.append(Step("pack", g.nbytes, scale_checked, (g, w.scale, w.flag)))
        plan.append(Step(collective.phase, g.nbytes, collective, (g, w.op, tag)))
        if w.flag is not None:
            flat = g.reshape(-1)
            plan.append(Step("unpack", g.nbytes, kernels.flag_nonfinite, ([flat], flat, [0], w.flag)))
    return plan


def plan_view(w: BucketWork, collective: BucketCollective) -> Plan:
    """Grads that are views of the bucket: the bucket scaled in place (a pass of its own even
    at scale 1 when the flag needs it), reduced, and checked (nothing writes the grads again)."""
    n = w.bucket.nbytes
    plan: Plan = []
    if w.flag is not None:
        plan.append(Step("pack", n, scale_flagged, (w.buf, w.scale, w.flag)))
    elif w.scale != 1.0:
        plan.append(Step("pack", n, kernels.scale_, (w.buf, w.scale)))
    plan.append(Step(collective.phase, n, collective, (w.buf, w.op, w.tag)))
    if w.flag is not None:
        views = param_views(w.bucket, w.buf)
        plan.append(Step("unpack", n, kernels.flag_nonfinite, (views, w.buf, w.bucket.offsets, w.flag)))
    return plan


def plan_premul_view(w: BucketWork, phase: str, premul_sum: Callable[[Any, float, str], None]) -> Plan:
    """A view bucket on a group that scales as it sums (`ProcessGroup.fuses_premul_sum`): one
    pre-multiplied sum, so the scale costs no pass over the bucket of its own."""
    return [Step(phase, w.bucket.nbytes, premul_sum, (w.buf, w.scale, w.tag))]


def plan_pack(w: BucketWork, collective: BucketCollective) -> Plan:
    """Grads that live elsewhere: one pack with the scale, the collective, one unpack (which
    writes every reduced value, so it raises the flag too)."""
    n, offsets = w.bucket.nbytes, w.bucket.offsets
    pack = functools.partial(kernels.pack, scale=w.scale, nonfinite_flag=w.flag)
    unpack = functools.partial(kernels.unpack, nonfinite_flag=w.flag)
    return [
        Step("pack", n, pack, (w.grads, w.buf, offsets)),
        Step(collective.phase, n, collective, (w.buf, w.op, w.tag)),
        Step("unpack", n, unpack, (w.grads, w.buf, offsets)),
    ]


def plan_compressed(
    w: BucketWork, view: bool, wire: Any, compression: str, collective: BucketCollective
) -> Plan:
    """A float32 bucket through a built-in fp16/bf16 hook: packed into `wire` (its buffer in the
    compression dtype) with the scale, `wire` reduced, unpacked widened back into the bucket
    (`view`) or the grads."""
    srcs, offsets = ([w.buf], [0]) if view else (w.grads, w.bucket.offsets)
    n = w.bucket.nbytes
    pack = functools.partial(kernels.pack, scale=w.scale, nonfinite_flag=w.flag)
    unpack = functools.partial(kernels.unpack, nonfinite_flag=w.flag)
    return [
        Step("pack", n, pack, (srcs, wire, offsets)),
        Step(collective.phase, wire.nbytes, collective, (wire, w.op, w.tag), compression),
        Step("unpack", n, unpack, (srcs, wire, offsets)),
    ]


def plan_compressed_fused(
    w: BucketWork, phase: str, compressed_sum: Callable[[Any, float, str, str], None], compression: str
) -> Plan:
    """A float32 view bucket through a built-in compression hook on a group that rounds as it
    sums (`ProcessGroup.fuses_compression`: float16 on the host's shared memory): one step, the
    bits of pack, reduce and unpack; its span counts the bytes a `compression` wire would carry."""
    wire_bytes = w.bucket.nbytes // 2
    return [Step(phase, wire_bytes, compressed_sum, (w.buf, w.scale, compression, w.tag), compression)]


def plan_comm_hook(w: BucketWork, run: Callable[..., None], args: Tuple[Any, ...]) -> Plan:
    """A registered comm hook: one step, `run(*args)` (`HookCall.run_comm_hook`)."""
    return [Step("hook", w.bucket.nbytes, run, args)]


class HookCall:
    """Calls a registered comm hook on a bucket, in comm-stream order (torch's `run_comm_hook`):
    the buffer it gets holds the unscaled grads (torch's contract); its result goes back into
    the bucket and the grads."""

    def __init__(self, group: ProcessGroup, specs: Sequence[ParamSpec], params: Sequence[Any]) -> None:
        self.group, self.specs, self.params = group, specs, params

    def run_comm_hook(
        self,
        layout: BucketLayout,
        b: int,
        mode: str,
        grads: List[Any],
        buf: Any,
        flag: Any,
        state: Any,
        hook: comm_hooks.CommHook,
    ) -> None:
        """`hook(state, bucket b)`; `mode` "pack": the grads are packed in first and unpacked after."""
        bucket = layout.buckets[b]
        offsets = list(bucket.offsets)
        if mode == "pack":
            kernels.pack(grads, buf, offsets, nonfinite_flag=flag)
        elif flag is not None:
            scale_flagged(buf, 1.0, flag)
        gb = comm_hooks.GradBucket(
            b,
            buf,
            offsets,
            [self.specs[p].shape for p in bucket.params],
            [self.params[p] for p in bucket.params],
            b == len(layout.buckets) - 1,
            self.group,
        )
        out = comm_hooks.resolve(hook(state, gb), hook)
        if out is not buf:
            self._check_result(out, buf, hook, bucket_tag(b, bucket.nbytes))
            copy_into(buf, out)
        if mode == "pack":
            kernels.unpack(grads, buf, offsets, nonfinite_flag=flag)
        elif flag is not None:
            kernels.flag_nonfinite(param_views(bucket, buf), buf, offsets, flag)

    def _check_result(self, out: Any, buf: Any, hook: comm_hooks.CommHook, tag: str) -> None:
        """The hook's value must be an array shaped and typed like the bucket's buffer."""
        name = getattr(hook, "__name__", hook)
        if not (hasattr(out, "shape") and hasattr(out, "dtype")):
            raise CommHookError(
                f"rank {self.group.rank}: comm hook {name!r} returned a future of "
                f"{comm_hooks.describe(out)} for {tag}; its value must be the reduced bucket "
                f"buffer, a {tuple(buf.shape)} {buf.dtype} array"
            )
        if tuple(out.shape) != tuple(buf.shape) or out.dtype != buf.dtype:
            raise CommHookError(
                f"rank {self.group.rank}: comm hook {name!r} "
                f"returned a {tuple(out.shape)} {out.dtype} array for "
                f"{tag}, which is {tuple(buf.shape)} {buf.dtype}; "
                "return the reduced bucket buffer (same shape and dtype)"
            )


def param_views(bucket: Bucket, buf: Any) -> List[Any]:
    """The bucket's parameter ranges of `buf` (not its padding), for the non-finite check."""
    return [buf[o : o + n] for o, n in zip(bucket.offsets, bucket.numels)]


def scale_checked(g: Any, f: float, flag: Optional[Any]) -> None:
    """PythonReducer's per-grad scale; with a flag, through the pack kernel, which sets it."""
    if flag is None:
        g *= g.dtype.type(f)
    else:
        scale_flagged(g.reshape(-1), f, flag)


def scale_flagged(buf: Any, f: float, flag: Any) -> None:
    """buf *= f, raising `flag` on a NaN/Inf: the pack kernel, in place on the host (the NumPy
    reference reads a segment before writing it); on the GPU from a copy, since the kernel's
    source and destination must not alias (it reads through the read-only cache)."""
    src = buf if isinstance(buf, np.ndarray) else buf.copy()
    kernels.pack([src], buf, [0], scale=f, nonfinite_flag=flag)
