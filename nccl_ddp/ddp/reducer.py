"""The reducer: tracks which grads are ready, launches bucket all-reduces in order while backward
is still running, and makes the compute stream wait for them at the end of the step. It schedules
(Megatron's bucket group: start_grad_sync / finish_grad_sync), in public phases: `start_step`,
`mark_ready(i)` -> `start_bucket(b)`, `finalize` (also the last grad's); adapters see it as their
`StepDriver`, and it calls their step hooks (the lifecycle in ddp/interfaces.py).

It works on native arrays (NumPy on "host", CuPy on "cuda") and a `Device`; it cannot tell which
device it runs on. Memory is `buckets.memory.BucketBuffers`, the layout `buckets.layout.BucketLayout`,
how a bucket is reduced `bucket_submit.BucketSubmitter`, the non-finite flags `finite_check`. The
mode ("view", "pack", "per_grad": grad_buckets.py) says how grads relate to the buckets (the same
numbers in all three). One step's counts are `step_state.StepState`, the small collectives at its
end `step_collectives.py`; with `DDPConfig.zero` the shard core is built here (zero/core.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.buckets.layout import BucketLayout, ParamSpec, assign_buckets
from nccl_ddp.buckets.memory import BucketBuffers, accumulate_into
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.ddp.bucket_submit import BucketSubmitter, Mode
from nccl_ddp.ddp.config import DDPConfig, GradPath
from nccl_ddp.ddp.finite_check import FiniteCheck, require_check
from nccl_ddp.ddp.grad_buckets import GradBuckets, InstallFn
from nccl_ddp.ddp.interfaces import NO_STEP_HOOKS, StepHooks
from nccl_ddp.ddp.step_collectives import UsedParams, rank0_order
from nccl_ddp.ddp.step_failure import StepFailure
from nccl_ddp.ddp.step_state import StepState
from nccl_ddp.device import Device
from nccl_ddp.errors import ConfigError, ReducerError
from nccl_ddp.profiling import Timeline
from nccl_ddp.zero.core import ShardCore, build_core, plan
from nccl_ddp.zero.reduce_scatter import ReduceScatter, refuse_unshardable

StreamScope = Callable[[], ContextManager[Any]]
"""stream_scope(): a context whose current stream is the framework's compute stream (torch: its
current CUDA stream made CuPy's); entered only around work that touches streams."""


class Reducer:
    """Per-step state machine: idle -> open (grads arriving, buckets launching) -> idle.

    A step opens with `prepare()` (the wrapper's forward) or the first `mark_ready`; it closes with
    `finalize()`, reached too once every bucketed grad is ready; `hooks` hear of both.

    `mark_ready` runs once per parameter per step, so its common case is a flat fast path: no
    stream, event, allocation or context manager unless a bucket completes (then a constant
    number of stream calls per bucket, inside `stream_scope()`).
    """

    def __init__(
        self,
        params: Sequence[Any],
        grads: List[Any],
        group: ProcessGroup,
        device: Device,
        config: DDPConfig,
        *,
        names: Optional[Sequence[Optional[str]]] = None,
        install: Optional[InstallFn] = None,
        install_param: Optional[InstallFn] = None,
        stream_scope: StreamScope = contextlib.nullcontext,
        pool_grads: bool = False,
        hooks: StepHooks = NO_STEP_HOOKS,
    ) -> None:
        self.params = list(params)
        self.hooks = hooks  # the wrapped model's (GradModule), told as steps open and end
        self.grads = grads  # native arrays; entries replaced by views on install
        self.group, self.device, self.config = group, device, config
        self.names = list(names) if names is not None else [None] * len(self.params)
        self.specs = [
            ParamSpec(tuple(p.shape), np.dtype(p.dtype), n) for p, n in zip(self.params, self.names)
        ]
        per_grad = config.grad_path is GradPath.PER_GRAD
        self.buckets = GradBuckets(self.specs, grads, device, group, per_grad=per_grad, install=install)
        self.stream_scope = stream_scope
        self.comm = device.new_stream()
        sharded = config.zero is not None and config.zero.stage == 2
        self.buckets.pooled = sharded and pool_grads  # ZeRO-2 over grads handed in per step: GradPool
        if sharded:
            refuse_unshardable(group.rank, per_grad, config.static_graph, None)
        self.sync_enabled = True  # False inside no_sync()
        self.closed: Optional[str] = None  # why close() was called (the wrapper then refuses steps)
        self.steps = 0  # synchronised steps finished
        self.used = UsedParams(len(self.params), config.find_unused_parameters, config.static_graph)
        self._arrival: List[int] = []
        self.step = StepState(len(self.params))  # ready bitmap, pending counts, done events
        self._uses_prepare = False
        self._failure = StepFailure(group.rank, "DistributedDataParallel", group)  # what broke a step
        self.on_open: Optional[Callable[[bool], None]] = None  # Join: on_open(syncs) per step
        self.step_divisor: Optional[int] = None  # Join: divide by the active ranks this step
        check = config.check_finite
        self._finite = FiniteCheck(check, device, group.rank, self.settle, self._label) if check else None
        base = assign_buckets(self.specs, config.cap_bytes, config.first_cap_bytes)
        self.shard_core: Optional[ShardCore] = None  # the shard core (config.zero), built here once
        shards = None if config.zero is None else plan(base, group, device)
        self.buckets.set(shards.layout if sharded and shards is not None else base)
        self._install_param = install_param
        if config.zero is not None:
            self.shard_core = build_core(
                config.zero,
                self.params,
                group,
                device,
                shards=shards,
                grad_memory=self.memory if sharded else None,
                fp32_grad_shards=False,  # stage 1: the optimizer reads our full grads as views
                install=None if install_param is None else self.param_moved,
                comm=self.comm,
                timeline=lambda: self.prof,
            )
        self.submitter = BucketSubmitter(
            group,
            device,
            self.comm,
            specs=self.specs,
            params=self.params,
            # the reduce-scatter (ZeRO-2) averages in the collective: the buckets keep local grads
            average_in_collective=config.average_in_collective or sharded,
            label=self._label,
            collective=None if self.shard_core is None else self.shard_core.reduce,  # None: all-reduce
        )

    @property
    def mode(self) -> Mode:
        return self.buckets.mode

    @property
    def layout(self) -> BucketLayout:
        return self.buckets.layout

    @property
    def memory(self) -> Optional[BucketBuffers]:  # the flat grad buffers (None: per grad, pooled)
        return self.buckets.memory

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
        return self.submitter.comm_hook

    def set_comm_hook(self, state: Any, hook: comm_hooks.CommHook) -> None:
        """Reduce every bucket through `hook(state, bucket)` from the next step on (the wrapper
        checks that it is registered once, before the first step)."""
        if self.sharding is not None:
            refuse_unshardable(self.group.rank, False, False, (state, hook))
        self.submitter.comm_hook = (state, hook)

    @property
    def sharding(self) -> Optional[ReduceScatter]:
        """ZeRO-2's reduce-scatter (its `outputs`: this rank's reduced grad shards), or None."""
        return None if self.shard_core is None else self.shard_core.reduce

    def param_moved(self, i: int, view: Any) -> None:
        """A shard core moved parameter i into its flat parameter buffer (`view`)."""
        self.params[i] = view
        if self._install_param is not None:
            self._install_param(i, view)

    def prepare(self) -> None:
        """Called by the wrapper's forward: the next grads belong to a new step."""
        self._failure.check()
        if self.step.open and self.step.syncs and self.step.count:
            raise ReducerError(
                self._missing_message(
                    "Expected to have finished reduction in the prior iteration before starting a new "
                    "one (forward was called again before every grad of the previous step was ready)",
                    self.config.find_unused_parameters,
                )
            )
        self._uses_prepare = True
        self.start_step()

    def start_step(self) -> None:
        """Open a step: the next grads belong to it (whether it reduces: `sync_enabled` now)."""
        self.step.start(self.layout, self.used.excluded, self.sync_enabled)
        if self._finite is not None and self.step.syncs:
            self._finite.open(self.layout, self.steps)
        if self.on_open is not None:
            self.on_open(self.step.syncs)
        self.hooks.step_opened(self.step.syncs)

    def mark_ready(self, i: int, grad: Any = None) -> Any:
        """Grad `i` of this step is final (`grad` given: add it to the accumulated grad first).

        Launches every bucket that is now complete and whose predecessors have launched; the last
        grad finalizes the step. Returns the accumulated grad array (a bucket view in view mode).
        """
        b, st = self.buckets.bucket_of[i], self.step
        # the common case, flat: a synchronised step already under way (`fast`: set by the
        # step's first grad, after the first step, whose arrival order the rebuild needs; cleared
        # when the step closes or fails), a bucketed grad seen first now
        if st.fast and b >= 0 and not st.ready[i]:
            if grad is not None and grad is not self.grads[i]:
                self.device.current_stream().submit(accumulate_into, self.grads[i], grad)
            if st.mark(i, b):  # a bucket can launch, or the step is complete
                with self.stream_scope(), self._failure.closes_step(self._abandon_step):
                    if st.count == st.expected:
                        with self.comm.awaited():  # the step waits for what is left at once
                            self._mark_backward_end()
                            self._launch_ready()
                            self._finish_step()
                    else:
                        self._launch_ready()
            return self.grads[i]
        with self.stream_scope():
            return self._mark_ready(i, grad)

    def _mark_ready(self, i: int, grad: Any) -> Any:
        """mark_ready's general path: opens the step, checks misuse, records the arrival order."""
        self._failure.check()
        st = self.step
        if not st.open:
            if self._uses_prepare:
                raise ReducerError(
                    f"rank {self.group.rank}: grad {self._label(i)} marked ready after the step was "
                    "finalized and before the next forward; call the DDP wrapper (forward) before "
                    "each backward, or use it only through mark_ready without forward calls"
                )
            self.start_step()
        st.check_new(i, self.group.rank, self.steps, self.used.excluded, self._label)
        if st.count == 0 and st.syncs:
            self.prof.mark("backward", "start", self.device.current_stream())
        if grad is not None and grad is not self.grads[i]:
            self.device.current_stream().submit(accumulate_into, self.grads[i], grad)
        with self._failure.closes_step(self._abandon_step):
            self._set_ready(i)
            if st.count == st.expected:
                self._finish_step()
        st.fast = st.open and st.syncs and self.steps > 0
        return self.grads[i]

    def not_ready(self, indices: Sequence[int]) -> List[int]:
        """Those of `indices` whose grad was not marked ready in the current (or last) step."""
        return [] if self.step.count == len(self.params) else [i for i in indices if not self.step.ready[i]]

    def _set_ready(self, i: int) -> None:
        """Count grad i as ready: a synchronised step may launch its bucket now; a no_sync() step
        remembers it as used for the next synchronised step."""
        if not self.step.syncs:
            self.step.mark(i, -1)
            self.used.unsynced.add(i)
            return
        if self.steps == 0:
            self._arrival.append(i)
        if self.step.mark(i, self.buckets.bucket_of[i]):
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Bucket b launches only after b-1, and as soon as all its grads are ready."""
        for b in self.step.launchable():
            self.start_bucket(b)

    def start_bucket(self, b: int) -> None:
        """Reduce bucket b on the comm stream once the compute stream has produced its grads."""
        # compute: ─ grads of b ready ─●record(ready)─── backward goes on ────────── finalize: wait(done) ─▶
        #                                 ╲                                           ╱
        # comm:    ──────────────────────wait(ready)─[pack]─[all-reduce]─[unpack]─●record(done)──────────
        bucket, mode = self.layout.buckets[b], self.mode
        # one rank, view mode, no hook or flags: the bucket's only work is the bookkeeping of an
        # identity all-reduce, nothing worth overlapping: an idle host comm stream runs it on
        # this thread instead of waking its worker (a CUDA stream queues it)
        alone = self.group.size == 1 and mode == "view" and self.comm_hook is None
        alone = alone and self._finite is None  # (view mode: the buffer is all the bucket needs)
        grads = [] if mode == "view" else [self.buckets.grad_for_pack(p) for p in bucket.params]
        with self.comm.awaited() if alone else contextlib.nullcontext():
            self.comm.wait(self.device.current_stream().record())
            buf = None if self.memory is None else self.memory.buffers[b]  # None: per grad/pool
            flag = None if self._finite is None else self._finite.flag(b)
            self.submitter.submit(self.layout, b, mode, grads, buf, flag, self.step_divisor)
            self.step.done.append(self.comm.record())

    def finalize(self) -> None:
        """The one end of a step: launch what is left, make the compute stream wait for every bucket.

        Without find_unused_parameters / static_graph a missing grad is an error. With them, the
        missing grads are reduced as they are (their local contribution this step is zero), then a
        bitmap all-reduce tells which params no rank used: those keep their previous grad.
        """
        self._failure.check()
        with self.stream_scope(), self._failure.closes_step(self._abandon_step), self.comm.awaited():
            self._finish_step()

    def _mark_backward_end(self) -> None:
        """The timeline's end of backward, once per step, before what is left is launched."""
        if not self.step.backward_ended:
            self.step.backward_ended = True
            self.prof.mark("backward", "end", self.device.current_stream())

    def _finish_step(self) -> None:
        """`finalize()`'s work, inside its stream scope and failure guard (also the last grad's)."""
        st = self.step
        st.fast = False
        if not st.open:
            return
        if not st.syncs:  # no_sync(): grads stay local and keep accumulating
            st.open = False
            self.hooks.step_ended(False)
            return
        if st.count < st.expected:  # (before the unsynced grads below count as ready)
            self.hooks.before_step_end(st.missing(self.used.excluded))
        self._mark_backward_end()
        # a grad accumulated in a no_sync() step since the last sync is part of this step's grad,
        # whether or not it got one now: it counts as used and is reduced (PyTorch's
        # local_used_map, which only a synchronised step clears)
        for i in self.used.take_unsynced():
            if not st.ready[i]:
                self._set_ready(i)
        checks_unused = self.used.checks(self.steps)
        missing = st.missing(self.used.excluded)
        if missing and not checks_unused:
            st.open = False
            raise ReducerError(
                self._missing_message("Expected every parameter to receive a grad before the end of the step")
            )
        saved = self.buckets.copies(missing if checks_unused else [], self.device.current_stream())
        if checks_unused:
            st.reduce_missing(missing, self.buckets.bucket_of)
            self._launch_ready()
        compute = self.device.current_stream()
        # compute: ── backward done ── wait(done 0) ... wait(done n-1) ── optimizer ─▶
        # comm:    ─[bucket 0]─●done 0 ─ ... ─[bucket n-1]─●done n-1
        for ev in st.done:
            compute.wait(ev)
        self.buckets.step_read()
        ready = np.frombuffer(st.ready, np.uint8)
        unused = self.used.end_step(
            self.group, self.device, self.comm, ready, missing, self._flags, self.steps
        )
        self.buckets.restore(unused, saved, compute)
        st.open = False
        self.prof.end_step()
        self._close_step()
        if self._finite is not None:
            self._finite.raise_if_flagged()
        self.hooks.step_ended(True)

    def settle(self) -> None:  # the reduced non-finite flags can be read (compute waited on them)
        self.device.current_stream().synchronize(self.group.timeout)

    @property
    def _flags(self) -> Any:  # check_finite's per-bucket flags (None without it)
        return None if self._finite is None else self._finite.flags

    def _close_step(self) -> None:
        self.steps += 1
        rebuilds = self.config.static_graph or not self.config.find_unused_parameters
        if self.steps == 1 and rebuilds and self.sharding is None:
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
        if self.step.open and self.step.count:
            raise ReducerError(
                f"rank {self.group.rank}: a step is half done ({self.step.count} "
                "grads ready) while this rank has joined; "
                "finish backward before leaving the Join block"
            )
        with self._failure.closes_step(self._abandon_step):
            self.step.open = self.step.fast = False
            if self._finite is not None:
                self._finite.open(self.layout, self.steps)
            compute = self.device.current_stream()
            self.comm.wait(compute.record())
            self.submitter.submit_zeros(self.layout, self.mode == "per_grad", self._flags, divisor)
            compute.wait(self.comm.record())
            missing = [i for i in range(len(self.params)) if i not in self.used.excluded]
            # torch's joined rank sends the used map of its last step (as reduced then), not
            # zeros: what it used then counts as used while it shadows
            used = self.used
            used.end_step(self.group, self.device, self.comm, used.globally, missing, self._flags, self.steps)
            self._close_step()

    @property
    def last_step_finite(self) -> Optional[bool]:
        """check_finite: whether every grad of the last synchronised step was finite on every
        rank (None before the first); reading it waits for the step's communication."""
        require_check(self.config.check_finite, self.group.rank, "DistributedDataParallel")
        return None if self._finite is None else self._finite.finite()

    def _rebuild(self) -> None:
        """Refill the buckets in the order rank 0's grads arrived in the first step."""
        order = rank0_order(self.group, self.device, self.comm, self._arrival, len(self.params))
        self._arrival = []
        caps = (self.config.cap_bytes, self.config.first_cap_bytes)
        self.buckets.rearrange(
            assign_buckets(self.specs, *caps, order=order, exclude=sorted(self.used.excluded))
        )

    def _abandon_step(self) -> None:
        """A launch or finalize raised (a collective failed: peer died, group destroyed): the
        step is half-reduced and the ranks are out of step; `self._failure` makes every later
        call say so instead of naming grads as missing."""
        self.step.open = self.step.fast = False

    def zero_grad(self) -> None:
        """Zero every grad (the buckets in view mode). Not allowed while a step is open."""
        self._failure.check()
        if self.step.open and self.step.count:
            raise ReducerError(
                f"rank {self.group.rank}: zero_grad() called in the middle of a step ("
                f"{self.step.count} grads already marked ready); call it before forward or "
                "after the optimizer step"
            )
        self.buckets.zero_(self.device.current_stream())

    def untouched_last_step(self) -> FrozenSet[int]:
        """Parameters the last synchronised step left as they were: unused on every rank
        (find_unused_parameters) or excluded from the buckets (static_graph)."""
        return self.used.unused_last_step | self.used.excluded

    def close(self, why: str = "close() was called") -> None:
        """Wait for pending communication (not after a failed step: its error was raised
        already) and release the comm stream; `closed` says why from now on. Once."""
        if self.closed is None:
            self.closed = why
            if self._failure.error is None:
                self.comm.synchronize(self.group.timeout)
            self.prof.close()
            self.comm.close()

    def _label(self, i: int) -> str:
        return f"{i} ({self.names[i]!r})" if 0 <= i < len(self.names) and self.names[i] else str(i)

    def _missing_message(self, head: str, finds_unused: bool = False) -> str:
        return self.step.missing_message(head, self.group.rank, self.used.excluded, self._label, finds_unused)
