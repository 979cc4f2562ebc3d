"""Sharded optimizer memory and its collectives (ZeRO-1/2), framework-free.

Per bucket of a `ShardLayout`: a flat parameter buffer in the model's dtype (the parameters become
views of it, as Megatron's param buffer), this rank's fp32 master shard (for an fp32 bucket the
owned slice of the parameter buffer itself, so no copy), and an fp32 grad shard. A step is
`collect_*` (the owned slice of the reduced grad into the fp32 grad shard; the torch optimizer
under ZeRO-1 reads the owned ranges of its full reduced grads as views instead), `global_norm`
(one all-reduce of the shard's squared norm: clipping and the non-finite skip), the
framework's optimizer stepping the master shard, then `gather` (master -> parameter shard, an
all-gather per bucket on the comm stream, waited on at once or per bucket by `wait_bucket`;
each one an "allgather" span on the step timeline, so its share hidden behind the next forward
is measured).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from nccl_ddp.buckets.memory import BucketBuffers, to_host
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.device import Device, Stream
from nccl_ddp.errors import ConfigError
from nccl_ddp.profiling import Timeline
from nccl_ddp.zero.layout import Piece, ShardLayout

log = logging.getLogger(__name__)

F32 = np.dtype(np.float32)


class ZeroShards:
    """The shard memory of one rank. `params`: native arrays, one per parameter of the layout;
    with `install(i, view)` they are moved into the flat parameter buffers (the framework's
    parameter i aliases `view` from then on), without it the gathered values are copied back
    into them after every all-gather. `timeline()`: the step timeline the all-gathers are timed
    on (read at each gather: the reducer's `prof`, which a user may replace); None: a quiet one.
    `fp32_grad_shards=False` (ZeRO-1 over a framework that keeps the full reduced grads, which
    the optimizer reads as views): no grad shard is allocated for an fp32 bucket (`grads[b]` is
    None there), only the fp32 widening of low-precision buckets."""

    def __init__(
        self,
        shards: ShardLayout,
        params: List[Any],
        group: ProcessGroup,
        device: Device,
        *,
        install: Optional[Callable[[int, Any], None]] = None,
        comm: Optional[Stream] = None,
        shard_grads: Optional[Sequence[Any]] = None,
        timeline: Optional[Callable[[], Timeline]] = None,
        fp32_grad_shards: bool = True,
    ) -> None:
        if group.size != shards.world:
            raise ConfigError(
                f"rank {group.rank}: shard layout is for {shards.world} ranks, the group has {group.size}"
            )
        self.shards, self.group, self.device = shards, group, device
        quiet = Timeline(group.rank, timeline=False, nvtx=False)
        self.timeline: Callable[[], Timeline] = timeline if timeline is not None else lambda: quiet
        self.rank = group.rank
        self.layout = shards.layout
        self.params = list(params)
        self.pieces: List[Piece] = shards.pieces(self.rank)
        self._owns_comm = comm is None
        self.comm = device.new_stream() if comm is None else comm
        compute = device.current_stream()
        # from the group: on the host's shm transport, peers read the shards in place (all_gather)
        self.param_buffers = BucketBuffers(self.layout, device, functools.partial(group.zeros, device))
        views = list(self.params)
        self.param_buffers.adopt_grads(
            views, [tuple(p.shape) for p in self.params], install or _no_install, compute
        )
        self._copy_back = install is None
        if not self._copy_back:
            self.params = views
        self.master: List[Any] = []
        self.grads: List[Any] = []  # fp32 grad shards (None: the framework's full grads, ZeRO-1)
        self._reduced = list(shard_grads) if shard_grads is not None else None  # ZeRO-2
        for b, bucket in enumerate(self.layout.buckets):
            own = self.owned_params(b)
            if np.dtype(bucket.dtype) == F32:
                self.master.append(own)
            else:
                m = device.zeros(len(own), F32)
                compute.submit(_cast_into, m, own)
                self.master.append(m)
            red = None if self._reduced is None else self._reduced[b]
            if red is not None and np.dtype(red.dtype) == F32:
                self.grads.append(red)
            elif np.dtype(bucket.dtype) == F32 and not fp32_grad_shards:
                self.grads.append(None)
            else:
                self.grads.append(device.zeros(len(own), F32))
        self._events: List[Any] = []

    # ------------------------------------------------------------------ views

    def owned_params(self, b: int) -> Any:
        """This rank's slice of bucket b's parameter buffer (model dtype)."""
        lo, hi = self.shards.owned(b, self.rank)
        return self.param_buffers.buffers[b][lo:hi]

    def master_piece(self, piece: Piece) -> Any:
        return self.master[piece.bucket][piece.shard_lo : piece.shard_lo + piece.numel]

    def grad_piece(self, piece: Piece) -> Any:
        return self.grads[piece.bucket][piece.shard_lo : piece.shard_lo + piece.numel]

    @property
    def nbytes(self) -> dict:
        """Bytes this rank holds, by kind: what the memory benchmark reports."""
        own = sum(self.owned_params(b).nbytes for b in range(len(self.master)))
        master = sum(m.nbytes for m in self.master) - sum(
            m.nbytes for b, m in enumerate(self.master) if np.dtype(self.layout.buckets[b].dtype) == F32
        )
        return {
            "param_buffers": self.param_buffers.nbytes,
            "owned_params": own,
            "master": master,
            "grad_shards": sum(g.nbytes for g in self.grads if g is not None),
        }

    # ------------------------------------------------------------------ grads in

    def collect_full(self, grads: Sequence[Any]) -> None:
        """ZeRO-1 into the fp32 grad shards: the owned ranges of full (already reduced) grads;
        a None grad reads as zero (the torch optimizer reads its full grads as views instead)."""
        compute = self.device.current_stream()
        for piece in self.pieces:
            g = grads[piece.param]
            dst = self.grad_piece(piece)
            if g is None:
                compute.submit(_fill0, dst)
            else:
                compute.submit(_cast_into, dst, g.reshape(-1)[piece.param_lo : piece.param_hi])

    def collect_reduced(self) -> None:
        """ZeRO-2: the reduce-scattered shards (already waited for by the reducer's finalize);
        an fp32 bucket's grad shard is the reduced shard itself, others are widened."""
        if self._reduced is None:
            raise ConfigError(
                f"rank {self.rank}: collect_reduced needs the reducer's shard grads "
                "(ZeRO-2); use collect_full with ZeRO-1"
            )
        compute = self.device.current_stream()
        for g, red in zip(self.grads, self._reduced):
            if g is not red:
                compute.submit(_cast_into, g, red)

    def global_norm(self, local_sq: Any = None) -> float:
        """The 2-norm of the whole (sharded) grad: the shards' squared norms summed on the
        device (`local_sq`: this rank's, computed by the caller; None: over `grads`), one
        all-reduce, one device-to-host read per step (not one per bucket). NaN or Inf when any
        rank's shard holds one: the same read is the step's finite check."""
        xp = self.device.xp
        buf = xp.zeros(1, np.float64)
        if local_sq is not None:
            buf += local_sq
        for g in self.grads if local_sq is None else ():
            if g is not None:
                buf += xp.dot(g, g)
        self.blocking(
            lambda s: self.group.all_reduce(
                buf, ReduceOp.SUM, stream=s, tag="the squared grad norm of every shard"
            )
        )
        return float(np.sqrt(to_host(buf)[0]))

    def scale_grads(self, factor: float) -> None:
        compute = self.device.current_stream()
        for g in self.grads:
            if g is not None:
                compute.submit(_scale, g, factor)

    # ------------------------------------------------------------------ params out

    def gather(self, wait: bool = True) -> None:
        """Write the updated master shards into the parameter buffers and all-gather them, one
        bucket at a time on the comm stream; `wait=False` leaves the waits to `wait_bucket`."""
        self.wait_all()  # the previous step's gathers are read before they are overwritten
        compute = self.device.current_stream()
        for b in range(len(self.master)):
            own = self.owned_params(b)
            if self.master[b] is not own:
                compute.submit(_cast_into, own, self.master[b])
        # compute: ── optimizer step ─●record ─ next forward: wait(gathered b) before bucket b's
        # comm:    ───────────────────wait─[all-gather 0]─●─[all-gather 1]─●─ ...   modules
        # The all-gathers join the group's queue now, in program order (stream=comm orders them
        # after the comm stream's work): a collective the caller issues before the next forward
        # comes after them on every rank, however far each rank's comm stream has got.
        self.comm.wait(compute.record())
        self._events = []
        prof = self.timeline()
        for b in range(len(self.master)):
            buf = self.param_buffers.buffers[b]
            with prof.enqueued(self.comm, "allgather", b, buf.nbytes):
                self.group.all_gather(
                    buf, self.owned_params(b), stream=self.comm, tag=f"parameter bucket {b}"
                )
                if self._copy_back:
                    self.comm.submit(self._copy_back_bucket, b)
            self._events.append(self.comm.record())
        if wait:
            self.wait_all()

    def wait_bucket(self, b: int) -> None:
        """The compute stream waits for bucket b's all-gather (no-op when it has)."""
        if b < len(self._events) and self._events[b] is not None:
            self.device.current_stream().wait(self._events[b])
            self._events[b] = None

    def wait_all(self) -> None:
        for b in range(len(self._events)):
            self.wait_bucket(b)

    @property
    def gather_pending(self) -> bool:
        return any(e is not None for e in self._events)

    def _copy_back_bucket(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        buf = self.param_buffers.buffers[b]
        for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            self.params[p][...] = buf[off : off + n].reshape(self.params[p].shape)

    def blocking(self, start: Callable[[Any], Any]) -> None:
        """`start(stream)` starts a collective (returns its Work): run it in comm-stream order
        and wait for it."""

        def run() -> None:
            start(self.device.current_stream()).wait(self.group.timeout)

        self.comm.wait(self.device.current_stream().record())
        with self.comm.awaited():
            self.comm.submit(run)
            self.comm.synchronize(self.group.timeout)

    def close(self) -> None:
        """Wait for pending all-gathers; release the comm stream when it is ours."""
        self.comm.synchronize(self.group.timeout)
        close = getattr(self.comm, "close", None)
        if self._owns_comm and close is not None:
            close()


def _no_install(i: int, view: Any) -> None:
    return None


def _cast_into(dst: Any, src: Any) -> None:
    dst[...] = src.astype(dst.dtype, copy=False)


def _fill0(dst: Any) -> None:
    dst[...] = 0


def _scale(g: Any, factor: float) -> None:
    g *= g.dtype.type(factor)
