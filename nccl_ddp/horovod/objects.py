"""Horovod's object collectives: `allgather_object` and `broadcast_object` of any picklable
object, the sizes negotiated by name like every Horovod op (negotiation.py)."""

from __future__ import annotations

import pickle
from typing import List, Optional, Tuple

import numpy as np

import nccl_ddp as nd
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod import negotiation
from nccl_ddp.horovod.arrays import NativeArray, host, xp_of
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.requests import Records


def _pickled(obj: object, where: str) -> Tuple[Optional[NativeArray], str]:
    """`obj` pickled as uint8, or (None, why) when it cannot be: every rank is told (the request
    carries it), so no later call pairs with this one."""
    try:
        return np.frombuffer(pickle.dumps(obj), np.uint8), ""
    except Exception as e:  # pickle raises many kinds: every one is reported to every rank
        return None, f"{type(e).__name__}: {e}"


def _refused(records: Records, group: ProcessGroup, where: str) -> None:
    bad = [group.ranks[i] for i, r in enumerate(records) if r is not None and r.shape == (-1,)]
    if bad:
        raise ConfigError(
            f"rank {nd.get_rank()}: {where}: the object of ranks {bad} could not be pickled (see "
            "that rank's error); no rank received anything, the next call starts afresh"
        )


def _wait_pickled(g: ProcessGroup, entry: negotiation.Entry, where: str, why: str) -> object:
    """The op's result; on the rank whose object failed to pickle, the pickling error."""
    try:
        return negotiation.wait(g, entry)
    except ConfigError:
        if why:
            raise ConfigError(f"rank {nd.get_rank()}: {where}: cannot pickle the object: {why}") from None
        raise


def allgather_object(
    obj: object, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> List[object]:
    """Every member's `obj` (pickled), in rank order: one all-gather, the sizes negotiated."""
    where = "hvd.allgather_object"
    g = group_of(process_set or global_process_set, where)
    data, why = _pickled(obj, where)

    def run(records: Records) -> List[object]:
        _refused(records, g, where)
        sizes = [r.shape[0] if r is not None else 0 for r in records]
        xp, longest = xp_of(g), max(sizes)
        mine = xp.zeros(longest, np.uint8)
        assert data is not None
        mine[: data.size] = xp.asarray(data)
        out = xp.zeros(g.size * longest, np.uint8)
        nd.all_gather(out, mine, group=g)
        flat = host(out)
        return [pickle.loads(flat[i * longest : i * longest + n].tobytes()) for i, n in enumerate(sizes)]

    entry = negotiation.submit(
        g, "ALLGATHER_OBJECT", name, run, where, dtype=1, shape=(-1 if data is None else data.size,)
    )
    out = _wait_pickled(g, entry, where, why if data is None else "")
    return out  # type: ignore[return-value]


def broadcast_object(
    obj: object, root_rank: int = 0, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> object:
    """`root_rank`'s `obj` (pickled) on every member: one broadcast, the size negotiated."""
    where = "hvd.broadcast_object"
    g = group_of(process_set or global_process_set, where)
    if root_rank not in g.ranks:
        raise ConfigError(f"{where}: root_rank {root_rank} is not a member (global ranks {list(g.ranks)})")
    root = g.ranks.index(root_rank)
    data, why = _pickled(obj, where) if g.rank == root else (np.zeros(0, np.uint8), "")

    def run(records: Records) -> object:
        _refused(records, g, where)
        rec = records[root]
        assert rec is not None
        buf = xp_of(g).zeros(rec.shape[0], np.uint8)
        if g.rank == root:
            assert data is not None
            buf[...] = xp_of(g).asarray(data)
            nd.broadcast(buf, src=root_rank, group=g)
            return obj
        nd.broadcast(buf, src=root_rank, group=g)
        return pickle.loads(host(buf).tobytes())

    size = -1 if data is None else data.size
    entry = negotiation.submit(
        g, "BROADCAST_OBJECT", name, run, where, dtype=1, shape=(size,), root=root_rank
    )
    return _wait_pickled(g, entry, where, why if data is None else "")
