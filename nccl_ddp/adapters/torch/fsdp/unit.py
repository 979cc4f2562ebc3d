"""One `fully_shard` unit (FSDP2's parameter group): its parameters' all-gather, wait, free and
grad reduce-scatter, and the `Schedule` its model's units share (the comm stream, the scratch
buffers, the order units ran in for prefetching, the reduce-scatters still in flight).

  compute: ─pre-forward(u)─wait(u)─[forward u]────────────wait(u+1)─[forward u+1]─
                  ╲ start(u), start(u+1)                     ╱
  comm:    ───────[all-gather u | copy out]─[all-gather u+1 | copy out]───────────

Backward is the mirror: a unit's pre-backward waits for its own gather and starts the one of
the unit that ran before it in forward; each of its post-backward calls (one per forward call
whose inputs needed a grad, as FSDP2's) packs and reduce-scatters the grads backward has made
since on the comm stream, and the end of backward waits for them all and adds the reduced shards
to the sharded grads, in the order they were reduced.
On CUDA the comm stream is a CuPy stream and the waits are the compute stream's (torch's current
stream), queued without blocking the host; on the host backend they block the calling thread.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from nccl_ddp.adapters.torch.fsdp.param import ShardedParam
from nccl_ddp.adapters.torch.tensors import from_native, to_native, torch_stream_current
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.device import CudaStream, Device, Event, Stream
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.params import ScratchPool, UnitShards

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


class State(enum.Enum):
    SHARDED = "sharded"  # only the shards exist
    GATHERING = "gathering"  # unsharded memory allocated, the all-gather in flight
    UNSHARDED = "unsharded"  # gathered and registered on the modules


class Phase(enum.Enum):
    """Where a unit is in a step (FSDP2's training states): what its hooks do next depends on it."""

    IDLE = "idle"  # between forward calls, or backward done
    FORWARD = "forward"  # a forward call in progress (for a group: until its last module ran)
    PRE_BACKWARD = "pre-backward"  # gathered for backward (a forward now is a recomputation)
    POST_BACKWARD = "post-backward"  # its grads so far reduced this backward


@dataclasses.dataclass
class UnitTimes:
    """What a unit's hooks cost the compute thread, summed since it was built (the benchmark
    reads them): `waited_s`, blocked on its all-gathers (the exposed, not hidden, part; ~0 on
    CUDA, where the wait is queued on the compute stream and a GPU trace shows the exposure);
    `hooks_s`, wall time in its hooks apart from those waits (the Python overhead, with the
    waits for the GIL and for a core); `hooks_cpu_s`, the compute thread's CPU time in them
    (the overhead itself); `gathers`."""

    waited_s: float = 0.0
    hooks_s: float = 0.0
    hooks_cpu_s: float = 0.0
    gathers: int = 0


class Schedule:
    """What the units of one root share. `comm`: the stream every collective of these units
    runs on, in issue order (the same on every rank); `scratch` / `gathers`: the grad packing
    buffers and the all-gather buffers; `forward_order` / `post_forward_order`: the units as
    their forwards began / ended in the first step (for prefetching), with each unit's place
    in them."""

    def __init__(self, group: ProcessGroup, device: Device, mesh: DeviceMesh) -> None:
        self.group, self.device, self.mesh = group, device, mesh
        self.comm: Stream = device.new_stream()
        self.scratch = ScratchPool(functools.partial(group.zeros, device))
        # the all-gathers' buffer per dtype (shared in stream order); on CUDA the stream-ordered
        # allocator already reuses each gather's memory, so none is kept there
        self.gathers = ScratchPool(device.empty) if device.kind == "host" else None
        self.units: List[Unit] = []
        self.root: Optional[Unit] = None
        self.forward_order: List[Unit] = []
        self.post_forward_order: List[Unit] = []
        self._forward_at: Dict[Unit, int] = {}
        self._post_forward_at: Dict[Unit, int] = {}
        self.recording = True
        # (unit, done event, reduced shards, which params had a grad): never the unsharded
        # grads, which the comm stream's pack holds only until it has read them
        self.pending: List[Tuple[Unit, Event, Optional[List[Any]], List[bool]]] = []
        self.end_queued = False
        self.end_full = False  # a pre-backward ran in this backward

    def adopt(self, unit: Unit) -> None:
        """`unit` (built before the root was sharded) joins this schedule."""
        old = unit.schedule
        unit.schedule = self
        if unit.reshard_unless_root:  # reshard_after_forward=None, and no longer the root
            unit.reshard_after_forward = True
        unit.shards.comm = self.comm
        unit.shards.scratch = self.scratch
        unit.shards.gathers = self.gathers
        self.units.append(unit)
        if old is not self:
            old.comm.close()

    def began_forward(self, unit: Unit) -> None:
        """While recording: `unit`'s forward begins (its first time: its place in the order)."""
        if self.recording and unit not in self._forward_at:
            self._forward_at[unit] = len(self.forward_order)
            self.forward_order.append(unit)

    def ended_forward(self, unit: Unit) -> None:
        if self.recording and unit not in self._post_forward_at:
            self._post_forward_at[unit] = len(self.post_forward_order)
            self.post_forward_order.append(unit)
        if unit is self.root:  # the first step's order is known now
            self.recording = False

    def next_in_forward(self, unit: Unit) -> Optional[Unit]:
        i = self._forward_at.get(unit, -1)
        return self.forward_order[i + 1] if 0 <= i < len(self.forward_order) - 1 else None

    def next_in_backward(self, unit: Unit) -> Optional[Unit]:
        i = self._post_forward_at.get(unit, -1)
        return self.post_forward_order[i - 1] if i > 0 else None

    @property
    def on_cuda(self) -> bool:
        return self.device.kind == "cuda"

    def compute_waits(self, event: Event) -> None:
        """The compute stream waits for `event`: on CUDA torch's current stream (made CuPy's
        by the hooks), with no host block; on the host the calling thread blocks, bounded by
        the group's timeout."""
        if self.on_cuda:
            self.device.current_stream().wait(event)
        else:
            event.synchronize(self.group.timeout)

    def queue_end_of_backward(self, *, full: bool = True) -> None:
        """Once per backward, when autograd's engine finishes: `end_of_backward` if any unit's
        pre-backward ran in it (`full`, torch's final callback), else (only post-backwards: a
        module of a group run apart, which has no pre-backward) `finish_reductions` alone, the
        other units left as they are (torch runs no callback then, and sets the sharded grads
        in the post-backward itself)."""
        self.end_full = self.end_full or full
        if not self.end_queued:
            import torch

            self.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward_on_stream)

    def _end_of_backward_on_stream(self) -> None:
        with torch_stream_current(self.on_cuda):
            if self.end_full:
                self.end_of_backward()
            else:
                self.end_queued = False
                self.finish_reductions()

    def end_of_backward(self) -> None:
        """Run the post-backward of every unit whose last one did not run since it was gathered
        or ran forward (no input needed a grad; a no-op with no grads), finish the reductions,
        reshard what backward left gathered."""
        self.end_queued = self.end_full = False
        for unit in self.units:
            if unit.phase is not Phase.POST_BACKWARD:
                unit.post_backward()
        self.finish_reductions()
        for unit in self.units:
            unit.phase = Phase.IDLE
            unit.to_run.clear()  # (a pass that ran only some of a group's modules starts afresh)
            if unit.reshard_after_backward and unit.state is not State.SHARDED:
                unit.reshard()
        if self.gathers is not None:
            self.gathers.release()  # the next gather is the next forward's

    def finish_reductions(self) -> None:
        """Wait for every reduce-scatter in flight and add its shards to the sharded grads, in
        the order they were reduced (torch's order of accumulation)."""
        pending, self.pending = self.pending, []
        for unit, event, outs, had_grad in pending:
            # compute: ─[backward]────────────wait(done)─[install the sharded grads]─
            # comm:    ─[pack | reduce-scatter]─●done┘
            self.compute_waits(event)
            unit.install_grads(outs, had_grad)

    def reset_iteration(self) -> None:
        """After an exception aborted a forward or backward (`reset_iter_state`): wait for the
        collectives in flight, drop the reduced shards not yet installed (the failed step's
        grads are lost, as torch's), reshard every unit and clear the step's trackers; an
        aborted first step is recorded again."""
        pending, self.pending = self.pending, []
        for _, event, _, _ in pending:
            self.compute_waits(event)
        for unit in self.units:
            unit.reset_iteration()
        self.end_queued = self.end_full = False
        if self.recording:
            self.forward_order, self.post_forward_order = [], []
            self._forward_at, self._post_forward_at = {}, {}
        if self.gathers is not None:
            self.gathers.release()

    def close(self) -> None:
        self.comm.close()


class Unit:
    """The parameters of one sharded module (those of sharded submodules excluded) and their
    collectives. `name`: the module's path in messages and collective tags."""

    def __init__(
        self,
        name: str,
        params: List[ShardedParam],
        shards: UnitShards,
        schedule: Schedule,
        *,
        reshard_after_forward: bool,
        reduce_dtype: Any,
    ) -> None:
        self.name, self.params, self.shards, self.schedule = name, params, shards, schedule
        self.reshard_after_forward = reshard_after_forward
        self.reshard_unless_root = False  # reshard_after_forward=None: True once adopted
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # set_unshard_in_backward
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: False keeps the reduce-scattered shards partial
        self._partial_had: List[bool] = []  # which parameters the partial shards hold grads of
        self.reduce_dtype = reduce_dtype  # numpy dtype of the reduce-scatter
        self.state = State.SHARDED
        self._gathered: Optional[Event] = None
        self.phase = Phase.IDLE
        self.forward_prefetch: Optional[List[Unit]] = None  # set_modules_to_forward_prefetch
        self.backward_prefetch: Optional[List[Unit]] = None
        self.to_run: Set[int] = set()  # a grouped unit's modules still to run forward this pass
        self.members: Tuple[Any, ...] = ()  # the modules fully_shard made this unit of
        self.complete_forward: Optional[Callable[[Any], Any]] = None  # its post-forward, on an output
        self.times = UnitTimes()

    # ------------------------------------------------------------------ all-gather

    def unshard(self) -> None:
        """Start the all-gather (no-op when gathered or in flight)."""
        if self.state is not State.SHARDED:
            return
        for p in self.params:
            if p.meta:  # moved by an _apply of a submodule that is not a sharded one: adopt it
                p.materialise()
        meta = [p.fqn for p in self.params if p.meta]
        if meta:
            raise ConfigError(
                f"rank {self.shards.rank}: parameter {meta[0]!r} of the fully_shard unit {self.name} "
                "is still on the meta device: after fully_shard, call module.to_empty(device='cpu') "
                "and initialise it (e.g. reset_parameters()) before the first forward"
            )
        outs = [p.alloc() for p in self.params]
        mirrors = [p for p in self.params if p.mirror is not None]
        before = functools.partial(_cast_all, mirrors) if mirrors else None
        self._gathered = self.shards.start_gather(outs, before)
        self.times.gathers += 1
        self.state = State.GATHERING

    def wait(self) -> None:
        """Block until the gather is done and compute with the unsharded parameters."""
        if self.state is State.SHARDED:
            self.unshard()
        if self.state is State.GATHERING:
            self._sync_gather()
            for p in self.params:
                p.register(unsharded=True)
            self.state = State.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded memory; the modules see the sharded DTensors again."""
        if self.state is State.SHARDED:
            return
        if self.state is State.GATHERING:  # the comm stream still writes into it
            self._sync_gather()
        for p in self.params:
            p.register(unsharded=False)
            p.free()
        self.state = State.SHARDED

    def _sync_gather(self) -> None:
        if self._gathered is not None:
            t0 = time.perf_counter()  # on CUDA the wait is queued, not blocked on: ~0
            # compute: ─pre-forward─wait(gathered)─[forward with the unsharded parameters]─
            # comm:    ─[all-gather | copy out]─●┘
            self.schedule.compute_waits(self._gathered)
            self.times.waited_s += time.perf_counter() - t0
            self._gathered = None

    def prefetch(self, units: Optional[List[Unit]], implicit: Optional[Unit], backward: bool = False) -> None:
        for u in units if units is not None else ([implicit] if implicit is not None else []):
            if u.unshard_in_backward or not backward:
                u.unshard()

    def reset_iteration(self) -> None:
        """`Schedule.reset_iteration`'s part for this unit: resharded (an in-flight gather
        waited for), no post-backward owed, the unreduced and partial grads dropped."""
        self.reshard()
        self.phase = Phase.IDLE
        self.to_run.clear()
        self._partial_had, self.shards.partial = [], None
        for p in self.params:
            p.unsharded.grad, p.grad_partial = None, None

    # ------------------------------------------------------------------ hooks' work

    def pre_forward(self) -> None:
        self.phase = Phase.FORWARD
        sched = self.schedule
        sched.began_forward(self)
        self.unshard()
        self.prefetch(self.forward_prefetch, sched.next_in_forward(self))
        self.wait()

    def post_forward(self) -> None:
        self.phase = Phase.IDLE
        self.schedule.ended_forward(self)
        if self.reshard_after_forward:
            self.reshard()

    def pre_backward(self) -> None:
        """Gather for backward (once until the next post-backward: a unit with several
        outputs gets a call from each)."""
        self.schedule.queue_end_of_backward()
        if self.phase is Phase.PRE_BACKWARD and self.state is not State.SHARDED:
            return
        self.phase = Phase.PRE_BACKWARD
        if self.unshard_in_backward:  # False: backward reads none of the parameters
            self.unshard()
        self.prefetch(self.backward_prefetch, self.schedule.next_in_backward(self), backward=True)
        if self.unshard_in_backward:
            self.wait()

    def post_backward_call(self) -> None:
        """Autograd got the grads of one forward call's inputs: reduce what this unit's grads
        got since (torch's per-call post-backward), and make sure the reductions finish by the end
        of backward (a module of a group run apart registers no pre-backward to queue it)."""
        self.schedule.queue_end_of_backward(full=False)
        self.post_backward()

    def post_backward(self) -> None:
        """Reduce-scatter the unsharded grads (or keep them, without gradient sync), and free
        the unsharded parameters when `reshard_after_backward`."""
        self.phase = Phase.POST_BACKWARD
        if not self.requires_gradient_sync:
            for p in self.params:
                p.keep_grad()
        else:
            self._reduce()
        if self.reshard_after_backward:
            self.reshard()

    def _reduce(self) -> None:
        grads: List[Optional[torch.Tensor]] = [p.take_grad() for p in self.params]
        if all(g is None for g in grads):
            return
        native = [None if g is None else to_native(g) for g in grads]
        event, outs = self.shards.start_reduce(
            native, self.reduce_dtype, ReduceOp.AVG, all_reduce=self.requires_all_reduce
        )
        had = [g is not None or bool(k) for g, k in zip(native, self._partial_had or [False] * len(native))]
        self._partial_had = had if outs is None else []
        if self.schedule.on_cuda:
            _read_on(self.schedule.comm, grads)
        self.schedule.pending.append((self, event, outs, had))

    def install_grads(self, outs: Optional[List[Any]], had_grad: List[bool]) -> None:
        """The reduced shards as the sharded grads of the parameters that had a grad in them
        (None: HSDP's partial shards, kept for a later backward that all-reduces)."""
        if outs is None:
            return
        for p, had in zip(self.params, had_grad):
            if had and p.requires_grad:
                p.add_sharded_grad(from_native(self.shards.grad_local(outs, p.index)), self.schedule.mesh)


def _read_on(comm: Stream, grads: List[Optional[torch.Tensor]]) -> None:
    """The comm stream's pack reads `grads` after this returns: torch's caching allocator must
    not give their memory to a new tensor of the compute stream before that (record_stream)."""
    import torch

    kept = [g for g in grads if g is not None]
    if not kept or not isinstance(comm, CudaStream):
        return
    stream = torch.cuda.ExternalStream(comm.ptr, device=kept[0].device)
    for g in kept:
        g.record_stream(stream)


def _cast_all(params: List[ShardedParam]) -> None:
    """Mixed precision: every fp32 shard rounded into the gather shard, on the comm stream."""
    for p in params:
        p.cast_into_mirror()
