"""The reducer's small collectives outside its buckets, each run in comm-stream order: at a
step's end the used-parameter bitmap (find_unused_parameters / static_graph's first step) and the
per-bucket non-finite flags (check_finite), fused into one all-reduce; after the first step rank
0's grad arrival order, which every rank rebuilds its buckets by."""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from nccl_ddp.buckets.memory import to_host
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp.bucket_submit import all_reduce_here
from nccl_ddp.device import Device, Stream


def reduce_used_and_flags(
    group: ProcessGroup, device: Device, comm: Stream, ready: np.ndarray, flags: Any, checks_unused: bool
) -> Optional[np.ndarray]:
    """After the step's buckets: one SUM all-reduce of the used bitmap (`ready`, when
    `checks_unused`) and the non-finite `flags` (when not None; reduced in place). Returns the
    reduced bitmap on the host (this blocks on it, as PyTorch's find_unused_parameters does at the
    end of backward), or None when it was not asked for (the compute stream then only waits on
    the flags, read lazily)."""
    if not checks_unused and flags is None:
        return None
    bitmap = ready.astype(np.int32) if checks_unused else np.zeros(0, np.int32)
    box: List[Any] = []
    comm.wait(device.current_stream().record())
    comm.submit(_reduce, group, device, bitmap, flags, box)
    if not checks_unused:
        device.current_stream().wait(comm.record())
        return None
    comm.synchronize(group.timeout)
    return np.asarray(to_host(box[0]))


def _reduce(group: ProcessGroup, device: Device, bitmap: np.ndarray, flags: Any, box: list) -> None:
    xp = device.xp
    parts = ([xp.asarray(bitmap)] if bitmap.size else []) + ([] if flags is None else [flags])
    buf = xp.concatenate(parts) if len(parts) > 1 else parts[0]
    what = " and ".join(
        w
        for w, on in (("the used-parameter bitmap", bitmap.size), ("the non-finite flags", flags is not None))
        if on
    )
    all_reduce_here(group, device, buf, ReduceOp.SUM, what)
    if flags is not None and len(parts) > 1:
        flags[...] = buf[bitmap.size :]
    box.append(buf)


def rank0_order(group: ProcessGroup, device: Device, comm: Stream, arrival: List[int], n: int) -> List[int]:
    """Rank 0's order of first arrival of the grads (`arrival` on rank 0; every rank calls it)."""
    order = np.full(n, -1, dtype=np.int64)
    arrived = list(dict.fromkeys(arrival))
    order[: len(arrived)] = arrived
    buf = device.xp.asarray(order)

    def broadcast() -> None:
        group.broadcast(buf, 0, stream=device.current_stream(), tag="rank 0's grad arrival order").wait(
            group.timeout
        )

    comm.wait(device.current_stream().record())
    comm.submit(broadcast)
    comm.synchronize(group.timeout)
    return [int(i) for i in to_host(buf) if i >= 0]


class UsedParams:
    """Which parameters got a grad, across steps: those used in no_sync() steps since the last
    synchronised one (they count as used there: PyTorch's local_used_map), those no rank used in
    the last synchronised step (`unused_last_step`: they keep their previous grad), those
    static_graph leaves out after its first step (`excluded`), and the last reduced used map
    (`globally`: what a joined rank sends while it shadows the others)."""

    def __init__(self, n: int, find_unused: bool, static_graph: bool) -> None:
        self.n, self.find_unused, self.static_graph = n, find_unused, static_graph
        self.excluded: frozenset = frozenset()
        self.unused_last_step: frozenset = frozenset()
        self.unsynced: set = set()
        self.globally = np.zeros(n, dtype=bool)

    def checks(self, steps: int) -> bool:
        """Whether the end of step `steps` finds the parameters no rank used (a bitmap)."""
        return self.find_unused or (self.static_graph and steps == 0)

    def take_unsynced(self) -> List[int]:
        """The parameters used in no_sync() steps since the last sync (then forgotten)."""
        out = sorted(self.unsynced - self.excluded)
        self.unsynced = set()
        return out

    def end_step(
        self,
        group: ProcessGroup,
        device: Device,
        comm: Stream,
        ready: np.ndarray,
        missing: List[int],
        flags: Any,
        steps: int,
    ) -> List[int]:
        """The closing collective of step `steps` (`reduce_used_and_flags`); returns the params
        of `missing` that no rank used, and remembers them."""
        used = reduce_used_and_flags(group, device, comm, ready, flags, self.checks(steps))
        unused = [] if used is None else [i for i in missing if used[i] == 0]
        if used is not None:
            self.globally = used[: self.n] > 0
        self.unused_last_step = frozenset(unused)
        if steps == 0 and self.static_graph:
            self.excluded = frozenset(unused)
        return unused
