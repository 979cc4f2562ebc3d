"""Our host group over a torch.distributed group of a backend we do not run ourselves: torch's
"threaded" test world (multi_threaded_pg: every rank a thread of one process), "mpi", "ucc", a
plugin's. torch's collectives carry the bytes; our host group keeps its worker thread, its stream
order, its timeouts and its errors (comm/host/carried.py). `groups.ours_for` hands these out, so
`fully_shard` on such a mesh, and our DDP or grad reducer given such a group, run on them.

torch's thread world keeps its group registry per thread, so the carrier calls the torch group
object's own collectives (never `dist.*`, which looks groups up in the calling thread's world)
from our group's worker thread. The reductions are torch's sums, maxima and products; the
pre-scale and AVG's division are ours (`Reduction`), so AVG truncates integers as everywhere in
nccl_ddp. One group of ours per torch group. In torch's thread world a group is its rank
thread's (the world is per thread): ours is shut down when that thread ends; elsewhere when
torch's group object is freed (torch's caches may keep it: then its idle worker, a daemon
thread, ends with the process).
"""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import Any, Callable, List, cast

import numpy as np
import torch
import torch.distributed as dist

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.carried import CarriedGroup
from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.errors import CommError, ConfigError
from nccl_ddp.job.env import DEFAULT_TIMEOUT

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # then Reduction.finish divides, as the host backend does
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}
_REFUSED = {"fake": "torch's fake backend runs no collectives (every result would be wrong)"}

_carried: weakref.WeakKeyDictionary[Any, CarriedGroup] = weakref.WeakKeyDictionary()
_THREAD_WORLDS = ("threaded",)  # backends whose world (and groups) belong to one thread
_per_thread = threading.local()  # .groups: a thread world's carried groups, built on that thread


class _ThreadGroups(dict):
    """A rank thread's carried groups (by torch group), shut down when the thread ends and
    Python frees the thread's locals."""

    def __init__(self) -> None:
        super().__init__()
        self.built: List[CarriedGroup] = []
        weakref.finalize(self, _shutdown_all, self.built)


def _shutdown_all(groups: List[CarriedGroup]) -> None:
    for g in groups:
        g.shutdown(wait=False)


def carried_group(group: Any, backend: str, argname: str) -> CarriedGroup:
    """Our group over torch group `group` of `backend` (one per torch group; built on first use,
    without communicating)."""
    thread_world = backend.lower() in _THREAD_WORLDS
    if thread_world and not hasattr(_per_thread, "groups"):
        _per_thread.groups = _ThreadGroups()
    cache = _per_thread.groups if thread_world else _carried
    found = cache.get(group)
    if found is not None:
        return cast(CarriedGroup, found)
    why = _REFUSED.get(backend.lower())
    if why is not None:
        raise ConfigError(f"rank {dist.get_rank()}: {argname} is a torch {backend!r} group: {why}")
    ranks = dist.get_process_group_ranks(group)
    name = f"torch-{backend}-group{ranks}".replace(" ", "")
    carrier = TorchCarrier(group, f"torch:{backend}", DEFAULT_TIMEOUT)
    ours = CarriedGroup(carrier, group.rank(), group.size(), ranks, DEFAULT_TIMEOUT, name)
    cache[group] = ours
    if thread_world:
        _per_thread.groups.built.append(ours)
    else:
        weakref.finalize(group, ours.shutdown)  # its worker thread ends with torch's group
    return ours


class TorchCarrier:
    """comm/host/carrier.py's `Carrier` over a torch process group (held weakly: torch owns it)."""

    def __init__(self, group: Any, kind: str, timeout: float) -> None:
        self.kind = kind
        self._group = weakref.ref(group)
        self._timeout = datetime.timedelta(seconds=timeout)

    def all_reduce(self, buf: Any, red: Reduction, desc: tuple) -> None:
        red.scale_all(buf)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS[red.op]
        self._run(lambda g: g.allreduce([_tensor(buf)], opts))
        red.finish(buf)

    def broadcast(self, buf: Any, root: int, desc: tuple) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._run(lambda g: g.broadcast([_tensor(buf)], opts))

    def all_gather(self, out: Any, inp: Any, desc: tuple) -> None:
        self._run(lambda g: g.allgather([_parts(out, g.size())], [_tensor(_writable(inp))]))

    def reduce_scatter(self, out: Any, inp: Any, red: Reduction, desc: tuple) -> None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[red.op]
        self._run(lambda g: g.reduce_scatter([_tensor(out)], [_parts(_writable(inp), g.size())], opts))
        red.finish(out)

    def barrier(self, desc: tuple) -> None:
        self._run(lambda g: g.barrier(dist.BarrierOptions()))

    def close(self) -> None:
        pass  # the torch group is torch's to destroy

    def _run(self, start: Callable[[Any], Any]) -> None:
        """Start a collective on the torch group and wait for it (torch's thread world has
        finished it when the call returns; other backends' works wait with our timeout)."""
        group = self._group()
        if group is None:
            raise CommError(f"{self.kind}: the torch process group was destroyed; this group is gone with it")
        work = start(group)
        if not work.is_completed() and not work.wait(self._timeout):
            raise CommError(f"{self.kind}: torch's work reported failure")


def _writable(a: np.ndarray) -> np.ndarray:
    """`a`, or a copy where it is read-only (torch tensors share only writable memory)."""
    return a if a.flags.writeable else a.copy()


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing `a`'s memory (bfloat16, ml_dtypes' in NumPy, crosses as int16)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _parts(a: np.ndarray, n: int) -> List[torch.Tensor]:
    """`a` cut into `n` equal views, in rank order (the buffers' sizes were checked)."""
    t, k = _tensor(a), a.size // n
    return [t[i * k : (i + 1) * k] for i in range(n)]
