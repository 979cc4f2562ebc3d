"""Parameter sharding (ZeRO-3), framework-free: one unit's parameters cut along dim 0 (or each
along a dim of its own: FSDP2's `Shard(d)`), its parameter all-gather and its grad reduce-scatter.

A unit is the set of parameters gathered together (FSDP2's parameter group: one module's own,
not those of a sharded submodule). Parameter i of dim-0 size `d` is cut in `world` chunks of
`rows[i] = ceil(d / world)` rows (torch.chunk's cut, FSDP2's and DTensor's `Shard(0)`): rank r
holds rows [r * rows[i], min(d, (r + 1) * rows[i])), the rest of its chunk is padding that stays
zero. This rank's chunks of every parameter of one dtype sit in one flat shard, laid out by
`buckets/layout.py` (one bucket per dtype, aligned offsets), so a unit's all-gather is one
collective per dtype into a buffer of `world` shards, rank after rank; each parameter's rows
are then copied out of the `world` chunks into its unsharded memory. The reduce-scatter is the
reverse: the unsharded grads are packed rank-major (padding rows zero) into a scratch buffer the
units share, reduced, and this rank's grad shard comes back in the shard's layout.

A parameter cut along dim d > 0 is seen as `(outer, size, inner)` (the dims before d, d itself,
those after it): rank r holds rows [r * rows[i], ...) of the middle dim, torch.chunk's cut on
dim d, stored compactly as a contiguous `(outer, local_rows, inner)` block at the start of its
chunk (the padding after it), so the framework's local tensor is contiguous; its copies are
strided ones per rank (zero/unit_copy.py `Strided`).

Everything a collective reads or writes runs on one comm stream in issue order (on the host
backend its worker thread; on CUDA a CuPy stream, NCCL collectives and the bucket kernels of
zero/unit_kernels.py): packing, the collective, the copy out, each batch after the compute
stream's work so far. Plain, frozen layout data; memory in `UnitShards`, scheduling in the
adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.buckets.layout import ALIGN_BYTES, BucketLayout, ParamSpec, assign_buckets, bucket_tag
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.device import Device, Event, Stream
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.unit_copy import (
    Cut,
    Strided,
    bucket_cuts,
    copy_out,
    copy_out_parts,
    copy_out_strided,
    pack,
    pack_strided,
)
from nccl_ddp.zero.unit_kernels import device_add_into, device_copy_out, device_pack

_ONE_BUCKET = 1 << 62  # a cap no unit reaches: one flat shard per dtype


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """`specs[i]`: parameter i's full shape and dtype; `dims[i]` the dim it is cut along,
    `rows[i]` the rows (of that dim) of its chunk on every rank, `row_numel[i]` the elements of
    one row (the dims after it), `outer[i]` the product of the dims before it (1 for dim 0);
    `shard`: the layout of one rank's flat shard (a bucket per dtype holding each parameter's
    chunk of `outer[i] * rows[i] * row_numel[i]` elements)."""

    specs: Tuple[ParamSpec, ...]
    world: int
    rows: Tuple[int, ...]
    row_numel: Tuple[int, ...]
    shard: BucketLayout
    dims: Tuple[int, ...]
    outer: Tuple[int, ...]

    def local_rows(self, i: int, rank: int) -> int:
        """The real (unpadded) rows of parameter i that `rank` holds: 0 past the end."""
        d = self.specs[i].shape[self.dims[i]]
        return max(0, min(self.rows[i], d - rank * self.rows[i]))

    def local_numel(self, i: int, rank: int) -> int:
        """The real elements of parameter i that `rank` holds (the start of its chunk)."""
        return self.outer[i] * self.local_rows(i, rank) * self.row_numel[i]

    def strided(self, i: int, offset: int) -> Strided:
        """The copy plan of parameter i (cut along a dim > 0) at `offset` of a rank's shard."""
        counts = tuple(self.local_rows(i, r) for r in range(self.world))
        size = int(self.specs[i].shape[self.dims[i]])
        return Strided(i, offset, self.outer[i], size, self.rows[i], self.row_numel[i], counts)

    def where(self, i: int) -> Tuple[int, int]:
        """(bucket, element offset) of parameter i's chunk in a rank's shard."""
        found = self.shard.locate(i)
        if found is None:  # every parameter has a bucket: assign_buckets excludes none here
            raise ConfigError(f"parameter {i} of the unit has no place in its shard layout")
        b, slot = found
        return b, self.shard.buckets[b].offsets[slot]

    def chunk_numel(self, i: int) -> int:
        return self.outer[i] * self.rows[i] * self.row_numel[i]

    def rank_rows(self, i: int) -> List[Tuple[int, int]]:
        """(first element, elements) of each rank's real rows of parameter i (cut along dim 0)
        in its flat unsharded array, rank after rank (0 elements past the end)."""
        per = self.row_numel[i]
        return [(r * self.rows[i] * per, self.local_rows(i, r) * per) for r in range(self.world)]


def unit_layout(
    specs: Sequence[ParamSpec],
    world: int,
    align_bytes: int = ALIGN_BYTES,
    dims: Optional[Sequence[int]] = None,
) -> UnitLayout:
    """The cut of `specs` for `world` ranks, parameter i along `dims[i]` (None: every one along
    dim 0). A parameter without dimensions cannot be cut, nor one along a dim it lacks:
    `ConfigError` naming it."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size for sharding must be a positive int, got {world!r}")
    dims = [0] * len(specs) if dims is None else [int(d) for d in dims]
    if len(dims) != len(specs):
        raise ConfigError(f"unit_layout got {len(dims)} shard dims for {len(specs)} parameters")
    rows, row_numel, outer = [], [], []
    for i, (s, d) in enumerate(zip(specs, dims)):
        if len(s.shape) == 0:
            raise ConfigError(
                f"parameter {s.name or i} has no dimensions, so it cannot be sharded along dim 0: "
                "give it shape (1,) (e.g. torch.nn.Parameter(t.reshape(1)))"
            )
        if not 0 <= d < len(s.shape):
            raise ConfigError(
                f"parameter {s.name or i} of shape {tuple(s.shape)} cannot be sharded along dim {d}: "
                f"choose a dim in [0, {len(s.shape)})"
            )
        rows.append(-(-int(s.shape[d]) // world))
        row_numel.append(int(np.prod(s.shape[d + 1 :], dtype=np.int64)))
        outer.append(int(np.prod(s.shape[:d], dtype=np.int64)))
    chunks = [ParamSpec((o * r * n,), s.dtype, s.name) for s, o, r, n in zip(specs, outer, rows, row_numel)]
    shard = assign_buckets(chunks, _ONE_BUCKET, _ONE_BUCKET, order=range(len(specs)), align_bytes=align_bytes)
    return UnitLayout(tuple(specs), world, tuple(rows), tuple(row_numel), shard, tuple(dims), tuple(outer))


class ScratchPool:
    """One growing buffer per dtype that every unit of a model packs its grads into before the
    reduce-scatter (from `zeros`: the group's, shared memory on the host's shm transport), or
    all-gathers into before the copy-out (from `device.empty`; where the group does not
    `gathers_in_parts`). Safe to share between units,
    even with two gathers in flight at once (a prefetch): everything that writes or reads it
    (pack, collective, copy-out) runs in issue order on the one comm stream they all use, so a
    gather writes the buffer only once the copy-out of the one before it has read it."""

    def __init__(self, zeros: Callable[[int, Any], Any]) -> None:
        self._zeros = zeros
        self._buffers: Dict[np.dtype, Any] = {}

    def release(self) -> None:
        """Drop the buffers (work already queued keeps its own reference): between steps, when
        nothing uses them, the memory goes back; the next `get` allocates again."""
        self._buffers.clear()

    def get(self, n: int, dtype: Any) -> Any:
        dt = np.dtype(dtype)
        buf = self._buffers.get(dt)
        if buf is None or buf.size < n:
            buf = self._buffers[dt] = self._zeros(n, dt)
        return buf[:n]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class UnitShards:
    """One unit's memory on this rank: `shards[b]`, its flat shard per dtype (from the group's
    `zeros`: peers read it in place on the shm transport), and the two collectives on `comm`.
    `name` says which unit, in collective tags and errors; `gathers`: the all-gather buffers
    (a `ScratchPool` of `device.empty`, the model's, shared by its units on the same comm
    stream, released by its owner between steps; None: a buffer allocated per gather and
    dropped after its copy-out, so a unit alone keeps none between its gathers), unused where
    the group `gathers_in_parts` (the host backend: the rows are copied straight out of every
    rank's shard). `gather_s`: the comm stream's time from the start of each gather to the end
    of its copy-out, summed."""

    def __init__(
        self,
        layout: UnitLayout,
        group: ProcessGroup,
        device: Device,
        comm: Stream,
        scratch: ScratchPool,
        name: str,
        *,
        replicate: Optional[ProcessGroup] = None,
        gathers: Optional[ScratchPool] = None,
    ) -> None:
        if group.size != layout.world:
            raise ConfigError(
                f"rank {group.rank}: {name}: the layout is for {layout.world} ranks, "
                f"the group has {group.size}"
            )
        self.layout, self.group, self.device, self.comm = layout, group, device, comm
        self.scratch, self.name, self.rank = scratch, name, group.rank
        self.replicate = replicate  # HSDP: the reduced shards are all-reduced over it too
        self.partial: Optional[List[Any]] = None  # HSDP: reduced shards not yet all-reduced
        self.shards: List[Any] = [group.zeros(device, b.padded, b.dtype) for b in layout.shard.buckets]
        self.gathers = gathers
        # per bucket: the (parameter, offset) of those cut along dim 0 (one segment per rank:
        # `_cuts`, and the bucket kernels' segments on CUDA) and the strided plans of the others
        self._flat: List[List[Tuple[int, int]]] = []
        self._strided: List[Tuple[Strided, ...]] = []
        for b in layout.shard.buckets:
            placed = list(zip(b.params, b.offsets))
            self._flat.append([(i, off) for i, off in placed if layout.dims[i] == 0])
            self._strided.append(tuple(layout.strided(i, off) for i, off in placed if layout.dims[i] != 0))
        dims0 = [s.shape[0] for s in layout.specs]
        self._cuts: List[Tuple[Cut, ...]] = [
            bucket_cuts([i for i, _ in flat], [off for _, off in flat], dims0, layout.rows, layout.row_numel)
            for flat in self._flat
        ]
        self.gather_s = 0.0
        self._gather_t0 = 0.0  # the running gather's start (one at a time per unit, in stream order)

    def chunk(self, i: int) -> Any:
        """Parameter i's whole chunk in this rank's shard (padding rows included), flat."""
        b, off = self.layout.where(i)
        return self.shards[b][off : off + self.layout.chunk_numel(i)]

    def local(self, i: int) -> Any:
        """This rank's real rows of parameter i, flat: what the framework's sharded parameter views."""
        return self.chunk(i)[: self.layout.local_numel(i, self.rank)]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def _tag(self, what: str, b: int) -> str:
        return f"{self.name} {what} {bucket_tag(b, self.layout.shard.buckets[b].nbytes)}"

    # ------------------------------------------------------------------ all-gather

    def start_gather(self, outs: Sequence[Any], before: Optional[Callable[[], None]] = None) -> Event:
        """Gather every rank's shards and copy parameter i's rows into `outs[i]` (flat, its full
        numel, the unsharded memory), all on the comm stream after `before()` (e.g. a cast into
        the shards). Returns the event to wait on before the unsharded values are read."""
        # compute: ─[optimizer writes the shards; frees what `outs` reuse]─●
        # comm:                                                            └wait─[cast]─[all-gather b
        #          | copy out b]─...─●done (the caller's compute stream waits on it)
        self.comm.wait(self.device.current_stream().record())
        self.comm.submit(self._begin_gather, before)
        buckets = self.layout.shard.buckets
        if self.device.kind != "cuda" and self.group.gathers_in_parts(self.device):
            # the rows straight out of every rank's shard (a peer's own, on the shm transport)
            for b in range(len(buckets)):
                copy = functools.partial(self._copy_out_parts, b, outs)
                self.group.all_gather_parts(self.shards[b], copy, self.comm, tag=self._tag("all-gather", b))
            self.comm.submit(self._end_gather)
            return self.comm.record()
        for b, bucket in enumerate(buckets):
            n = bucket.padded * self.layout.world
            if self.gathers is not None:
                gathered = self.gathers.get(n, bucket.dtype)
            else:
                with self.comm.allocating():  # freed in the comm stream's order
                    gathered = self.device.empty(n, bucket.dtype)
            self.group.all_gather(gathered, self.shards[b], self.comm, tag=self._tag("all-gather", b))
            self.comm.submit(self._copy_out, b, gathered, outs, b == len(buckets) - 1)
        return self.comm.record()

    def _begin_gather(self, before: Optional[Callable[[], None]]) -> None:
        self._gather_t0 = time.perf_counter()
        if before is not None:
            before()

    def _copy_out(self, b: int, gathered: Any, outs: Sequence[Any], last: bool) -> None:
        """On the comm stream: the rows out of bucket b's gather (the last one's: the gather's
        time, on the host; on CUDA this only queues the kernels)."""
        if self.device.kind == "cuda":
            bucket = self.layout.shard.buckets[b]
            device_copy_out(self.layout, gathered, bucket.padded, self._flat[b], outs)
        else:
            copy_out(self._cuts[b], gathered, self.layout.world, outs)
        if self._strided[b]:  # NumPy's or CuPy's slicing (on CuPy's current stream: the comm one)
            copy_out_strided(self._strided[b], gathered.reshape(self.layout.world, -1), outs)
        if last:
            self._end_gather()

    def _copy_out_parts(self, b: int, outs: Sequence[Any], parts: Sequence[Any]) -> None:
        copy_out_parts(self._cuts[b], outs, parts)
        if self._strided[b]:
            copy_out_strided(self._strided[b], parts, outs)

    def _end_gather(self) -> None:
        self.gather_s += time.perf_counter() - self._gather_t0

    # ------------------------------------------------------------------ reduce-scatter

    def start_reduce(
        self,
        grads: Sequence[Optional[Any]],
        dtype: Any = None,
        op: ReduceOp = ReduceOp.AVG,
        *,
        all_reduce: bool = True,
    ) -> Tuple[Event, Optional[List[Any]]]:
        """Reduce the unsharded grads (flat arrays, full numel; None reads as zeros) over the
        group in `dtype` (None: each bucket's own): packed rank-major into the shared scratch
        buffer, reduce-scattered with `op`. Returns the done event and this rank's reduced
        shards (one flat array per bucket, in the shard layout: `grad_local` cuts parameter i's
        rows out of them). HSDP (`replicate`): the shards are all-reduced over it too, with the
        partial shards kept since added in; `all_reduce=False` skips that all-reduce and adds
        the shards to the partial ones instead (returned as None: no grad to install yet)."""
        # compute: ─[backward writes the grads]─●
        # comm:                                 └wait─[pack b | reduce-scatter b]─...─●done
        self.comm.wait(self.device.current_stream().record())
        outs = []
        for b, bucket in enumerate(self.layout.shard.buckets):
            n, dt = bucket.padded, bucket.dtype if dtype is None else dtype
            with self.comm.allocating():  # freed in the comm stream's order
                packed = self.scratch.get(n * self.layout.world, dt)
                out = self.device.empty(n, dt)
            flat = [grads[i] for i, _ in self._flat[b]]
            if self.device.kind == "cuda":
                self.comm.submit(device_pack, self.layout, packed, n, self._flat[b], flat, self.scratch)
            else:
                self.comm.submit(pack, self._cuts[b], packed, self.layout.world, flat)
            if self._strided[b]:
                strided = [grads[s.param] for s in self._strided[b]]
                self.comm.submit(pack_strided, self._strided[b], packed, self.layout.world, strided)
            self.group.reduce_scatter(out, packed, op, self.comm, tag=self._tag("reduce-scatter", b))
            outs.append(out)
        if self.replicate is None:
            return self.comm.record(), outs
        if self.partial is not None:  # the shards reduced since the last all-reduce, added in
            self.comm.submit(device_add_into if self.device.kind == "cuda" else _add_into, outs, self.partial)
        if not all_reduce:
            self.partial = outs
            return self.comm.record(), None
        self.partial = None
        for b, out in enumerate(outs):
            self.replicate.all_reduce(out, op, self.comm, tag=self._tag("replicate all-reduce", b))
        return self.comm.record(), outs

    def grad_local(self, outs: Sequence[Any], i: int) -> Any:
        """This rank's real rows of parameter i's reduced grad, flat, from `start_reduce`'s shards."""
        b, off = self.layout.where(i)
        return outs[b][off : off + self.layout.local_numel(i, self.rank)]


def _add_into(outs: Sequence[Any], partial: Sequence[Any]) -> None:
    """Each bucket's partial shard added into its newly reduced one."""
    for out, part in zip(outs, partial):
        out += part
