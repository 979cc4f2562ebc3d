"""The reducer: tracks which grads are ready, launches bucket all-reduces in order while backward
is still running, and makes the compute stream wait for them at the end of the step.

It works on native arrays (NumPy on "host", CuPy on "cuda") and a `Device`; it cannot tell which
device it runs on. Memory is `bucket_memory.BucketBuffers`, the layout `buckets.BucketLayout`,
how a bucket is reduced `bucket_submit.BucketSubmitter`, the non-finite flags
`finite_check.FiniteCheck`; this module schedules (Megatron's bucket group: start_grad_sync /
finish_grad_sync).

The mode (`DDPConfig.reducer_mode` and the module) says how grads relate to the buckets:
- "view":   CppReducer, grads are views of the bucket (zero copy, PyTorch's
            gradient_as_bucket_view).
- "pack":   CppReducer, the grads live elsewhere: packed into the bucket and unpacked back.
- "python": PythonReducer, one all-reduce per grad, no fused kernels.
All three give the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.ddp.bucket_memory import BucketBuffers, copy_into, to_host
from nccl_ddp.ddp.bucket_submit import BucketSubmitter, Mode, all_reduce_here
from nccl_ddp.ddp.buckets import BucketLayout, ParamSpec, assign_buckets
from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.ddp.finite_check import FiniteCheck, require_check
from nccl_ddp.ddp.step_failure import StepFailure
from nccl_ddp.errors import ConfigError, ReducerError
from nccl_ddp.profiling import Timeline
from nccl_ddp.zero.grads import ReduceScatter, refuse_unshardable
from nccl_ddp.zero.layout import ShardLayout, shard_layout

log = logging.getLogger(__name__)

InstallFn = Callable[[int, Any], None]
"""install(i, view): make the framework's grad of parameter i alias `view` from now on."""

StreamScope = Callable[[], ContextManager[Any]]
"""stream_scope(): a context in which `device.current_stream()` is the framework's compute stream
(torch: its current CUDA stream made CuPy's). Entered only around work that touches streams."""


class Reducer:
    """Per-step state machine: idle -> open (grads arriving, buckets launching) -> idle.

    A step opens with `prepare()` (the wrapper's forward) or the first `mark_ready`; it closes with
    `finalize()`, called automatically once every bucketed grad is ready.

    `mark_ready` runs once per parameter per step, so its common case is a flat fast path: no
    stream, event, allocation or context manager unless a bucket completes (then a constant
    number of stream calls per bucket, inside `stream_scope()`).
    """

    def __init__(
        self,
        params: Sequence[Any],
        grads: List[Any],
        group: ProcessGroup,
        device: Any,
        config: DDPConfig,
        *,
        names: Optional[Sequence[Optional[str]]] = None,
        install: Optional[InstallFn] = None,
        stream_scope: StreamScope = contextlib.nullcontext,
    ) -> None:
        self.params = list(params)
        self.grads = grads  # native arrays; entries replaced by views on install
        self.group, self.device, self.config = group, device, config
        self.names = list(names) if names is not None else [None] * len(self.params)
        self.specs = [
            ParamSpec(tuple(p.shape), np.dtype(p.dtype), n) for p, n in zip(self.params, self.names)
        ]
        self._install = install
        self.stream_scope = stream_scope
        self.comm = device.new_stream()
        self.submitter = BucketSubmitter(
            group,
            device,
            self.comm,
            specs=self.specs,
            params=self.params,
            average_in_collective=config.average_in_collective,
            label=self._label,
        )
        self.sync_enabled = True  # False inside no_sync()
        self.steps = 0  # synchronised steps finished
        self.excluded: frozenset = frozenset()  # static graph: unused in step 1, never reduced
        self.unused_last_step: frozenset = frozenset()  # no rank used them (find_unused/static)
        self._used_unsynced: set = set()  # marked ready in no_sync() steps since the last sync
        self._arrival: List[int] = []
        self._ready = bytearray(len(self.params))  # 1: grad i is ready this step
        self._count = 0  # grads ready this step (ones in _ready)
        self._open = False
        self._fast = False  # mark_ready may take its fast path (see there)
        self._backward_ended = False  # this step's end of backward is on the timeline
        self._step_syncs = True
        self._uses_prepare = False
        self._failure = StepFailure(group.rank, "DistributedDataParallel")  # what broke a step
        self.on_open: Optional[Callable[[bool], None]] = None  # Join: on_open(syncs) per step
        self.step_divisor: Optional[int] = None  # Join: divide by the active ranks this step
        self._used_globally = np.zeros(len(self.params), dtype=bool)  # by the last bitmap
        self._finite = (
            FiniteCheck(config.check_finite, device, group.rank, self._settle, self._label)
            if config.check_finite
            else None
        )
        self.sharding: Optional[ReduceScatter] = None  # ZeRO-2 (enable_sharding)
        self._set_layout(assign_buckets(self.specs, config.cap_bytes, config.first_cap_bytes))

    # ------------------------------------------------------------------ layout and memory

    @property
    def mode(self) -> Mode:
        if self.config.reducer_mode == "PythonReducer":
            return "python"
        return "view" if self._views_installed else "pack"

    @property
    def prof(self) -> Timeline:
        """The NVTX ranges / per-step timeline (off unless switched on); replaceable."""
        return self.submitter.prof

    @prof.setter
    def prof(self, timeline: Timeline) -> None:
        self.submitter.prof = timeline

    @property
    def comm_hook(self) -> Optional[Tuple[Any, comm_hooks.CommHook]]:
        """(state, hook) of the registered comm hook, or None."""
        return self.submitter.hook

    def set_comm_hook(self, state: Any, hook: comm_hooks.CommHook) -> None:
        """Reduce every bucket through `hook(state, bucket)` from the next step on (the wrapper
        checks that it is registered once, before the first step)."""
        if self.sharding is not None:
            refuse_unshardable(self.group.rank, "", False, (state, hook))
        self.submitter.hook = (state, hook)

    def enable_sharding(self, reduce_dtype: Any = None) -> ShardLayout:
        """ZeRO-2: from the next step each bucket is reduce-scattered (averaged in the
        collective; the local grads stay as they are) into this rank's shard of it
        (`sharding.outputs`); the layout is padded for the group and no longer rebuilt.
        `reduce_dtype`: None reduces in the grads' dtype, float32 widens bf16/fp16 buckets."""
        if self.sharding is not None:
            if self.sharding.reduce_dtype != reduce_dtype:
                raise ConfigError(
                    f"rank {self.group.rank}: this model is already sharded with reduce_dtype="
                    f"{self.sharding.reduce_dtype}; a second sharded optimizer asked for {reduce_dtype}"
                )
            return self.sharding.shards
        refuse_unshardable(
            self.group.rank, self.config.reducer_mode, self.config.static_graph, self.submitter.hook
        )
        if self._open and self._count:
            raise ReducerError(
                f"rank {self.group.rank}: sharding enabled in the middle of a "
                "step; build the sharded optimizer before the first backward"
            )
        shards = shard_layout(self.layout, self.group.size, self.device.align_bytes)
        self._set_layout(shards.layout)
        assert self.memory is not None  # CppReducer (refused above otherwise)
        self.sharding = ReduceScatter(self.group, self.device, shards, self.memory, reduce_dtype)
        self.submitter.collective = self.sharding
        self.submitter.average_in_collective = True
        return shards

    def _set_layout(self, layout: BucketLayout) -> None:
        """Allocate buffers for `layout`; in CppReducer mode move the grads into bucket views."""
        self.layout = layout
        # per parameter: its bucket, or -1 (excluded); what mark_ready's fast path reads
        self._bucket_of = [-1] * len(self.params)
        for b in layout.buckets:
            for p in b.params:
                self._bucket_of[p] = b.index
        self._unbucketed = [i for i, b in enumerate(self._bucket_of) if b < 0]
        self.memory: Optional[BucketBuffers] = None
        self._views_installed = False
        if self.config.reducer_mode == "PythonReducer":
            return
        self.memory = BucketBuffers(layout, self.device)
        if self._install is None:  # the framework cannot alias its grads: pack/unpack
            return
        self.memory.adopt_grads(
            self.grads, [s.shape for s in self.specs], self._install, self.device.current_stream()
        )
        self._views_installed = True
        log.debug("rank %d: bucket layout %s (%s mode)", self.group.rank, layout.summary(), self.mode)

    # ------------------------------------------------------------------ per step

    def prepare(self) -> None:
        """Called by the wrapper's forward: the next grads belong to a new step."""
        self._failure.check()
        if self._open and self._step_syncs and self._count:
            raise ReducerError(
                self._missing_message(
                    "Expected to have finished reduction in the prior iteration before starting a new "
                    "one (forward was called again before every grad of the previous step was ready)"
                )
            )
        self._uses_prepare = True
        self._open_step()

    def _open_step(self) -> None:
        n = len(self.params)
        self._ready = bytearray(n)
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._next = 0
        self._done: list = []
        self._expected = n - len(self.excluded)
        self._count = 0
        self._open = True
        self._fast = False
        self._backward_ended = False
        self._step_syncs = self.sync_enabled
        if self._finite is not None and self._step_syncs:
            self._finite.open(self.layout, self.steps)
        if self.on_open is not None:
            self.on_open(self._step_syncs)

    def mark_ready(self, i: int, grad: Any = None) -> Any:
        """Grad `i` of this step is final (`grad` given: add it to the accumulated grad first).

        Launches every bucket that is now complete and whose predecessors have launched; the last
        grad finalizes the step. Returns the accumulated grad array (a bucket view in view mode).
        """
        b = self._bucket_of[i]
        # the common case, flat: a synchronised step already under way (`_fast`: set by the
        # step's first grad, after the first step, whose arrival order the rebuild needs; cleared
        # when the step closes or fails), a bucketed grad seen first now
        if self._fast and b >= 0 and not self._ready[i]:
            if grad is not None and grad is not self.grads[i]:
                self.device.current_stream().submit(_accumulate, self.grads[i], grad)
            self._ready[i] = 1
            self._count += 1
            pending = self._pending
            pending[b] -= 1
            if (b == self._next and not pending[b]) or self._count == self._expected:
                with self.stream_scope(), self._failure.closes_step(self._abandon_step):
                    if self._count == self._expected:
                        with self.comm.awaited():  # the step waits for what is left at once
                            self._mark_backward_end()
                            self._launch_ready()
                            self._finalize()
                    else:
                        self._launch_ready()
            return self.grads[i]
        with self.stream_scope():
            return self._mark_ready(i, grad)

    def _mark_ready(self, i: int, grad: Any) -> Any:
        """mark_ready's general path: opens the step, checks misuse, records the arrival order."""
        self._failure.check()
        if not self._open:
            if self._uses_prepare:
                raise ReducerError(
                    f"rank {self.group.rank}: grad {self._label(i)} marked ready after the step was "
                    "finalized and before the next forward; call the DDP wrapper (forward) before "
                    "each backward, or use it only through mark_ready without forward calls"
                )
            self._open_step()
        if self._ready[i]:
            raise ReducerError(
                f"rank {self.group.rank}: Expected to mark a variable ready only once. Parameter "
                f"{self._label(i)} was marked ready twice in step {self.steps}. Causes: the grad hook "
                "ran twice (the parameter is used twice with a hook per use, or backward ran twice "
                "without a forward in between); mark each parameter once per backward."
            )
        if i in self.excluded and self._step_syncs:
            raise ReducerError(
                f"rank {self.group.rank}: parameter {self._label(i)} received a grad, but with "
                "static_graph=True it was unused in the first step and is no longer reduced; the "
                "graph is not static: use find_unused_parameters=True instead"
            )
        if self._count == 0 and self._step_syncs:
            self.prof.mark("backward", "start", self.device.current_stream())
        if grad is not None and grad is not self.grads[i]:
            self.device.current_stream().submit(_accumulate, self.grads[i], grad)
        with self._failure.closes_step(self._abandon_step):
            self._set_ready(i)
            if self._count == self._expected:
                self._finalize()
        self._fast = self._open and self._step_syncs and self.steps > 0
        return self.grads[i]

    def not_ready(self, indices: Sequence[int]) -> List[int]:
        """Those of `indices` whose grad was not marked ready in the current (or just finalized)
        step."""
        if self._count == len(self.params):
            return []
        return [i for i in indices if not self._ready[i]]

    def _set_ready(self, i: int) -> None:
        """Count grad i as ready: a synchronised step may launch its bucket now; a no_sync() step
        remembers it as used for the next synchronised step."""
        self._ready[i] = 1
        self._count += 1
        if not self._step_syncs:
            self._used_unsynced.add(i)
            return
        if self.steps == 0:
            self._arrival.append(i)
        b = self._bucket_of[i]
        if b >= 0:
            self._pending[b] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Bucket b launches only after b-1, and as soon as all its grads are ready."""
        while self._next < len(self.layout.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        # compute: ─ grads of b ready ─●record(ready)─── backward goes on ────────── finalize: wait(done) ─▶
        #                                 ╲                                           ╱
        # comm:    ──────────────────────wait(ready)─[pack]─[all-reduce]─[unpack]─●record(done)──────────
        bucket, mode = self.layout.buckets[b], self.mode
        # one rank, view mode, no hook or flags: the bucket's only work is the bookkeeping of an
        # identity all-reduce, nothing worth overlapping: an idle host comm stream runs it on
        # this thread instead of waking its worker (a CUDA stream queues it)
        alone = (
            self.group.size == 1 and mode == "view" and self.submitter.hook is None and self._finite is None
        )
        with self.comm.awaited() if alone else contextlib.nullcontext():
            self.comm.wait(self.device.current_stream().record())
            # (in view mode the grads are views of the buffer: the buffer is all it needs)
            grads = [] if mode == "view" else [self.grads[p] for p in bucket.params]
            buf = None if self.memory is None else self.memory.buffers[b]  # None: PythonReducer
            flag = None if self._finite is None else self._finite.flag(b)
            self.submitter.submit(self.layout, b, mode, grads, buf, flag, self.step_divisor)
            self._done.append(self.comm.record())

    def _broadcast_here(self, buf: Any, tag: str) -> None:
        """Rank 0's `buf` to every rank, in comm-stream order (like `all_reduce_here`)."""
        self.group.broadcast(buf, 0, stream=self.device.current_stream(), tag=tag).wait(self.group.timeout)

    def finalize(self) -> None:
        """End the step: launch what is left, make the compute stream wait for every bucket.

        Without find_unused_parameters / static_graph a missing grad is an error. With them, the
        missing grads are reduced as they are (their local contribution this step is zero), then a
        bitmap all-reduce tells which params no rank used: those keep their previous grad.
        """
        self._failure.check()
        with self.stream_scope(), self._failure.closes_step(self._abandon_step), self.comm.awaited():
            self._finalize()

    def _mark_backward_end(self) -> None:
        """The timeline's end of backward: the last grad is in (once per step, before what is
        left is launched, which may run on this thread: it is not hidden behind backward)."""
        if not self._backward_ended:
            self._backward_ended = True
            self.prof.mark("backward", "end", self.device.current_stream())

    def _finalize(self) -> None:
        self._fast = False
        if not self._open:
            return
        if not self._step_syncs:  # no_sync(): grads stay local and keep accumulating
            self._open = False
            return
        self._mark_backward_end()
        # a grad accumulated in a no_sync() step since the last sync is part of this step's grad,
        # whether or not it got one now: it counts as used and is reduced (PyTorch's
        # local_used_map, which only a synchronised step clears)
        for i in sorted(self._used_unsynced - self.excluded):
            if not self._ready[i]:
                self._set_ready(i)
        self._used_unsynced = set()
        checks_unused = self._checks_unused()
        missing = (
            []
            if self._count == len(self.params)
            else [i for i in range(len(self.params)) if not self._ready[i] and i not in self.excluded]
        )
        if missing and not checks_unused:
            self._open = False
            raise ReducerError(
                self._missing_message("Expected every parameter to receive a grad before the end of the step")
            )
        saved = {}
        if checks_unused:
            compute = self.device.current_stream()
            for i in missing:
                saved[i] = _copy_of(self.device, compute, self.grads[i])
                if self._bucket_of[i] >= 0:
                    self._pending[self._bucket_of[i]] -= 1
            self._launch_ready()
        compute = self.device.current_stream()
        # compute: ── backward done ── wait(done 0) ... wait(done n-1) ── optimizer ─▶
        # comm:    ─[bucket 0]─●done 0 ─ ... ─[bucket n-1]─●done n-1
        for ev in self._done:
            compute.wait(ev)
        unused_everywhere = self._end_collectives(
            np.frombuffer(self._ready, np.uint8), missing, checks_unused
        )
        for i in unused_everywhere:
            compute.submit(copy_into, self.grads[i], saved[i])
        self.unused_last_step = frozenset(unused_everywhere)
        self._open = False
        self.prof.end_step()
        self._close_step(unused_everywhere)
        if self._finite is not None:
            self._finite.raise_if_flagged()

    def _checks_unused(self) -> bool:
        """Whether this step's end finds the parameters no rank used (a bitmap all-reduce)."""
        return self.config.find_unused_parameters or (self.config.static_graph and self.steps == 0)

    def _settle(self) -> None:
        """Wait until the step's reduced non-finite flags can be read (the compute stream
        waits on them)."""
        self.device.current_stream().synchronize(self.group.timeout)

    def _end_collectives(self, ready: np.ndarray, missing: list, checks_unused: bool) -> list:
        """The step's closing collective, after its buckets: the used-parameter bitmap
        (find_unused_parameters) and the per-bucket non-finite flags (check_finite), fused into
        one small all-reduce. Returns the params in `missing` that no rank used."""
        flags = None if self._finite is None else self._finite.flags
        if not checks_unused and flags is None:
            return []
        bitmap = ready.astype(np.int32) if checks_unused else np.zeros(0, np.int32)
        box: list = []
        self.comm.wait(self.device.current_stream().record())
        self.comm.submit(self._reduce_bitmap_and_flags, bitmap, flags, box)
        if not checks_unused:  # check_finite only: read lazily (or at once with "raise")
            self.device.current_stream().wait(self.comm.record())
            return []
        # blocks on the bitmap, as PyTorch's find_unused_parameters does at the end of backward
        self.comm.synchronize(self.group.timeout)
        used = to_host(box[0])
        self._used_globally = used[: len(self.params)] > 0
        return [i for i in missing if used[i] == 0]

    def _reduce_bitmap_and_flags(self, bitmap: np.ndarray, flags: Any, box: list) -> None:
        xp = self.device.xp
        parts = ([xp.asarray(bitmap)] if bitmap.size else []) + ([] if flags is None else [flags])
        buf = xp.concatenate(parts) if len(parts) > 1 else parts[0]
        what = " and ".join(
            w
            for w, on in (
                ("the used-parameter bitmap", bitmap.size),
                ("the non-finite flags", flags is not None),
            )
            if on
        )
        all_reduce_here(self.group, self.device, buf, ReduceOp.SUM, what)
        if flags is not None and len(parts) > 1:
            flags[...] = buf[bitmap.size :]
        box.append(buf)

    def _close_step(self, unused_everywhere: list) -> None:
        first = self.steps == 0
        self.steps += 1
        if first and self.config.static_graph:
            self.excluded = frozenset(unused_everywhere)
        if (
            first
            and (self.config.static_graph or not self.config.find_unused_parameters)
            and self.sharding is None
        ):
            self._rebuild()

    def shadow_step(self, divisor: Optional[int] = None) -> None:
        """A joined rank's stand-in for one synchronised step of the ranks still training (Join):
        the same collectives in the same order, on zeros; its own grads stay as they are.
        `divisor`: what the training ranks divide by (None: the group size)."""
        self._failure.check()
        if self.sharding is not None:
            raise ConfigError(
                f"rank {self.group.rank}: Join with a sharded optimizer (ZeRO-2): a joined rank "
                "cannot stand in for the reduce-scatter and the parameter all-gather of the "
                "others; give every rank the same number of batches (or use ZeRO-1)"
            )
        if self._open and self._count:
            raise ReducerError(
                f"rank {self.group.rank}: a step is half done ({self._count} "
                "grads ready) while this rank has joined; "
                "finish backward before leaving the Join block"
            )
        with self._failure.closes_step(self._abandon_step):
            self._open = self._fast = False
            if self._finite is not None:
                self._finite.open(self.layout, self.steps)
            mode: Mode = "python" if self.mode == "python" else "view"
            compute = self.device.current_stream()
            self.comm.wait(compute.record())
            for b, bucket in enumerate(self.layout.buckets):
                buf = self.device.zeros(bucket.padded, bucket.dtype)
                grads = [buf[o : o + n] for o, n in zip(bucket.offsets, bucket.numels)]
                flag = None if self._finite is None else self._finite.flag(b)
                self.submitter.submit(self.layout, b, mode, grads, buf, flag, divisor)
            compute.wait(self.comm.record())
            missing = [i for i in range(len(self.params)) if i not in self.excluded]
            # torch's joined rank sends the used map of its last step (as reduced then), not
            # zeros: what it used then counts as used while it shadows
            used = self._used_globally
            unused = self._end_collectives(used, missing, self._checks_unused())
            self.unused_last_step = frozenset(unused)
            self._close_step(unused)

    @property
    def last_step_finite(self) -> Optional[bool]:
        """check_finite: whether every grad of the last synchronised step was finite on every
        rank (None before the first); reading it waits for the step's communication."""
        require_check(self.config.check_finite, self.group.rank, "DistributedDataParallel")
        return None if self._finite is None else self._finite.finite()

    def _rebuild(self) -> None:
        """Refill the buckets in the order rank 0's grads arrived in the first step."""
        n = len(self.params)
        order = np.full(n, -1, dtype=np.int64)
        arrived = list(dict.fromkeys(self._arrival))
        order[: len(arrived)] = arrived
        buf = self.device.xp.asarray(order)
        self.comm.wait(self.device.current_stream().record())
        self.comm.submit(self._broadcast_here, buf, "rank 0's grad arrival order")
        self.comm.synchronize(self.group.timeout)
        rank0_order = [int(i) for i in to_host(buf) if i >= 0]
        layout = assign_buckets(
            self.specs,
            self.config.cap_bytes,
            self.config.first_cap_bytes,
            order=rank0_order,
            exclude=sorted(self.excluded),
        )
        self._arrival = []
        if layout.buckets == self.layout.buckets:
            return
        self._set_layout(layout)
        log.info("rank %d: buckets rebuilt in arrival order: %s", self.group.rank, layout.summary())

    def _abandon_step(self) -> None:
        """A launch or finalize raised (a collective failed: peer died, group destroyed): the
        step is half-reduced and the ranks are out of step; `self._failure` makes every later
        call say so instead of naming grads as missing."""
        self._open = self._fast = False

    # ------------------------------------------------------------------ accumulation

    def zero_grad(self) -> None:
        """Zero every grad (the buckets in view mode). Not allowed while a step is open."""
        self._failure.check()
        if self._open and self._count:
            raise ReducerError(
                f"rank {self.group.rank}: zero_grad() called in the middle of a step ("
                f"{self._count} grads already marked ready); call it before forward or "
                "after the optimizer step"
            )
        compute = self.device.current_stream()
        if self.mode == "view" and self.memory is not None:
            for buf in self.memory.buffers:
                compute.submit(kernels.zero_, buf)
            rest = [self.grads[i] for i in self._unbucketed]
        else:
            rest = self.grads
        for g in rest:
            compute.submit(kernels.zero_, g)

    def close(self) -> None:
        """Wait for pending communication (not after a failed step: its error was raised
        already) and release the comm stream."""
        if self._failure.error is None:
            self.comm.synchronize(self.group.timeout)
        self.prof.close()
        close = getattr(self.comm, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ messages

    def _label(self, i: int) -> str:
        name = self.names[i] if 0 <= i < len(self.names) else None
        return f"{i} ({name!r})" if name else str(i)

    def _missing_message(self, head: str) -> str:
        missing = [i for i in range(len(self.params)) if not self._ready[i] and i not in self.excluded]
        shown = ", ".join(self._label(i) for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        return (
            f"rank {self.group.rank}: {head}. This error indicates that your module has "
            "parameters that were not used in producing loss. Parameter indices which did not "
            f"receive grad for rank {self.group.rank}: {shown}{more}. You can enable unused "
            "parameter detection by passing find_unused_parameters=True to "
            "DistributedDataParallel (and calling finalize() after backward), or make sure every "
            "parameter gets a grad (mark_ready) in every step."
        )


def _accumulate(dst: Any, src: Any) -> None:
    dst += src.reshape(dst.shape)


def _copy_of(device: Any, stream: Any, x: Any) -> Any:
    out = device.xp.empty_like(x)
    stream.submit(copy_into, out, x)
    return out
