"""Bucket submission: how one bucket's grads reach the collective, queued on the comm stream.

The reducer decides *when* a bucket goes (readiness, launch order); this module decides *how*:

- "per_grad" (reducer_mode="PythonReducer"): one collective per grad, each scaled by 1/world
  first (no fused kernels).
- "view" (grads are views of the bucket): scale the bucket in place (unless AVG), reduce it; on a
  group that fuses the two (`premul_sum`, the host backend), one pre-multiplied sum.
- "pack" (grads live elsewhere): one fused pack with the scale, reduce, one unpack.
- `HookPath.COMPRESSED` (either of the two, a built-in fp16/bf16 hook on a float32 bucket): pack into
  a buffer of the compression dtype with the scale, reduce that, unpack widened back.
- `HookPath.HOOK` (any other registered hook): the hook on the unscaled bucket; its result copied back.

The collective is a choice (`BucketCollective`): every path reduces its flat buffer through it.
Today's is `AllReduce`; a sharded optimizer's reduce-scatter into the rank's slice is one more.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Sequence, Tuple

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import Bucket, BucketLayout, ParamSpec, bucket_tag
from nccl_ddp.buckets.memory import copy_into
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.device import Device, Stream
from nccl_ddp.errors import CommHookError
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


class BucketCollective(Protocol):
    """Reduces a bucket's flat buffer across the group, run in comm-stream order (a submitted
    task, so the current stream is the comm stream). `phase`: its name on the timeline."""

    phase: str

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None: ...


class AllReduce:
    """The whole buffer, reduced in place on every rank."""

    phase = "allreduce"

    def __init__(self, group: ProcessGroup, device: Device) -> None:
        self.group, self.device = group, device

    def __call__(self, buf: Any, op: ReduceOp, tag: str) -> None:
        all_reduce_here(self.group, self.device, buf, op, tag)

    @property
    def fuses_scale(self) -> bool:
        """The group scales and sums in one pass (`ProcessGroup.premul_sum`: the host backend)."""
        return self.group.premul_sum and self.device.kind == "host"

    def premul_sum(self, buf: Any, scale: float, tag: str) -> None:
        """buf = the sum over ranks of scale * buf, in stream order (see `all_reduce_here`)."""
        group = self.group
        group.all_reduce_premul_sum(buf, scale, stream=self.device.current_stream(), tag=tag).wait(
            group.timeout
        )


def all_reduce_here(group: ProcessGroup, device: Device, buf: Any, op: ReduceOp, tag: str) -> None:
    """An all-reduce run in stream order: cuda enqueues it on the current (comm) stream without
    blocking; host runs it on the group's worker while this stream waits. `tag` names the buffer
    in errors ("bucket 3 (1.0 MiB)")."""
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
        self.specs, self.params, self.label = specs, params, label
        self.average_in_collective = average_in_collective
        self.collective: BucketCollective = AllReduce(group, device) if collective is None else collective
        # a GradPool (ZeRO-2 over grads handed in per step): "pack" mode's buffers, zeroed first
        self.pool = getattr(self.collective, "pool", None)
        self.prof = Timeline(group.rank)  # NVTX ranges / per-step timeline when switched on
        self.comm_hook: Optional[Tuple[Any, comm_hooks.CommHook]] = None
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
            grads = [buf[o : o + n] for o, n in zip(bucket.offsets, bucket.numels)]
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
        """Queue bucket b of `layout` on the comm stream. `grads`: the bucket's grads (unused
        in "view" mode, where they are views of `buf`); `buf`: its buffer (None in "per_grad"
        mode); a Join shadow passes zeros. `flag`: the bucket's non-finite flag or None.
        `divisor`: the ranks the step divides by (None: the group)."""
        bucket = layout.buckets[b]
        scale, op = self.scale_and_op(divisor)
        submit, comm, tag = self.prof.submit, self.comm, bucket_tag(b, bucket.nbytes)
        collective = self.collective
        if mode == "per_grad":
            for p, g in zip(bucket.params, grads):
                if scale != 1.0 or flag is not None:
                    submit(comm, "pack", b, g.nbytes, _scale_checked, g, scale, flag)
                submit(
                    comm, collective.phase, b, g.nbytes, collective, g, op, f"grad {self.label(p)} of {tag}"
                )
                if flag is not None:  # what the reduction handed back (an overflowing sum)
                    flat = g.reshape(-1)
                    submit(comm, "unpack", b, g.nbytes, kernels.flag_nonfinite, [flat], flat, [0], flag)
            return
        path, compression = self.hook_path(bucket)
        if path is HookPath.HOOK and self.comm_hook is not None:
            state, hook = self.comm_hook
            submit(
                comm,
                "hook",
                b,
                bucket.nbytes,
                self._run_comm_hook,
                layout,
                b,
                mode,
                grads,
                buf,
                flag,
                state,
                hook,
            )
            return
        offsets = bucket.offsets
        if mode == "pack" and self.pool is not None:  # zeroed in stream order, after its last reader
            buf = self.pool.buffers[b]
            submit(comm, "pack", b, bucket.nbytes, self.pool.clear, b)
        srcs, offs = ([buf], [0]) if mode == "view" else (grads, offsets)
        if path is HookPath.COMPRESSED:  # pack into the compression dtype, reduce it, widen back
            wbuf = self._compressed_buffer(layout, b, compression)
            submit(
                comm,
                "pack",
                b,
                bucket.nbytes,
                functools.partial(
                    kernels.pack, scale=1.0 / (divisor or self.group.size), nonfinite_flag=flag
                ),
                srcs,
                wbuf,
                offs,
            )
            submit(
                comm, collective.phase, b, wbuf.nbytes, collective, wbuf, ReduceOp.SUM, tag, dtype=compression
            )
            submit(
                comm,
                "unpack",
                b,
                bucket.nbytes,
                functools.partial(kernels.unpack, nonfinite_flag=flag),
                srcs,
                wbuf,
                offs,
            )
            return
        if mode == "view":
            if flag is None and scale != 1.0 and isinstance(collective, AllReduce) and collective.fuses_scale:
                submit(comm, collective.phase, b, bucket.nbytes, collective.premul_sum, buf, scale, tag)
                return  # the scale costs no pass over the bucket of its own
            if flag is not None:
                submit(comm, "pack", b, bucket.nbytes, _scale_flagged, buf, scale, flag)
            elif scale != 1.0:
                submit(comm, "pack", b, bucket.nbytes, kernels.scale_, buf, scale)
        else:
            submit(
                comm,
                "pack",
                b,
                bucket.nbytes,
                functools.partial(kernels.pack, scale=scale, nonfinite_flag=flag),
                grads,
                buf,
                offsets,
            )
        submit(comm, collective.phase, b, bucket.nbytes, collective, buf, op, tag)
        if mode == "pack":  # the unpack writes every reduced value: it raises the flag too
            submit(
                comm,
                "unpack",
                b,
                bucket.nbytes,
                functools.partial(kernels.unpack, nonfinite_flag=flag),
                grads,
                buf,
                offsets,
            )
        elif flag is not None:  # the grads are views of the bucket: nothing writes them again
            submit(
                comm,
                "unpack",
                b,
                bucket.nbytes,
                kernels.flag_nonfinite,
                _views(bucket, buf),
                buf,
                offsets,
                flag,
            )

    def _compressed_buffer(self, layout: BucketLayout, b: int, compression: str) -> Any:
        """Bucket b's buffer in the compression dtype (allocated once per layout)."""
        key = (layout, b)
        buf = self._compressed_buffers.get(key)
        if buf is None:
            self._compressed_buffers = {k: v for k, v in self._compressed_buffers.items() if k[0] is layout}
            buf = self._compressed_buffers[key] = self.device.zeros(
                layout.buckets[b].padded, comm_hooks.compression_dtype(compression)
            )
        return buf

    def _run_comm_hook(
        self,
        layout: BucketLayout,
        b: int,
        mode: Mode,
        grads: List[Any],
        buf: Any,
        flag: Any,
        state: Any,
        hook: comm_hooks.CommHook,
    ) -> None:
        """A registered hook on bucket b, in comm-stream order: the buffer it gets holds the
        unscaled grads (torch's contract); its result goes back into the bucket and the grads."""
        bucket = layout.buckets[b]
        offsets = list(bucket.offsets)
        if mode == "pack":
            kernels.pack(grads, buf, offsets, nonfinite_flag=flag)
        elif flag is not None:
            _scale_flagged(buf, 1.0, flag)
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
            name, tag = getattr(hook, "__name__", hook), bucket_tag(b, bucket.nbytes)
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
            copy_into(buf, out)
        if mode == "pack":
            kernels.unpack(grads, buf, offsets, nonfinite_flag=flag)
        elif flag is not None:
            kernels.flag_nonfinite(_views(bucket, buf), buf, offsets, flag)


def _views(bucket: Bucket, buf: Any) -> List[Any]:
    """The bucket's parameter ranges of `buf` (not its padding), for the non-finite check."""
    return [buf[o : o + n] for o, n in zip(bucket.offsets, bucket.numels)]


def _scale_checked(g: Any, f: float, flag: Any) -> None:
    """The per-grad path's scale; with a flag, through the pack kernel, which sets it."""
    if flag is None:
        g *= g.dtype.type(f)
    else:
        _scale_flagged(g.reshape(-1), f, flag)


def _scale_flagged(buf: Any, f: float, flag: Any) -> None:
    """buf *= f, raising `flag` on a NaN/Inf: the pack kernel, in place on the host (the NumPy
    reference reads a segment before writing it); on the GPU from a copy, since the kernel's
    source and destination must not alias (it reads through the read-only cache)."""
    src = buf if isinstance(buf, np.ndarray) else buf.copy()
    kernels.pack([src], buf, [0], scale=f, nonfinite_flag=flag)
