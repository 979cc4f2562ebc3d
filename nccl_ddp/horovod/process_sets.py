"""Horovod's process sets over our groups (horovod/common/process_sets.py): a `ProcessSet(ranks)`
is an `nccl_ddp.new_group(ranks)` once registered, at `hvd.init(process_sets=...)` or by
`add_process_set`, which every rank calls, as in Horovod."""

from __future__ import annotations

import itertools
from typing import Iterable, List, Optional, Union

import nccl_ddp as nd
from nccl_ddp.comm.group import NonMemberGroup, ProcessGroup
from nccl_ddp.errors import ConfigError, ConfigTypeError


class ProcessSet:
    """Horovod's process set: a sorted list of global ranks, an nccl_ddp group once registered."""

    def __init__(self, ranks_or_comm: Iterable[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise ConfigTypeError(
                f"ProcessSet takes a list of global ranks, got {type(ranks_or_comm).__name__} "
                f"{ranks_or_comm!r} (MPI communicators are not supported)"
            )
        self.ranks: List[int] = sorted(int(r) for r in ranks_or_comm)
        self.process_set_id: Optional[int] = None
        self._group: Union[ProcessGroup, NonMemberGroup, None] = None

    def _register(self, group: Union[ProcessGroup, NonMemberGroup], set_id: int = 0) -> None:
        self._group, self.process_set_id = group, set_id
        if not self.ranks:  # the global set
            self.ranks = list(range(nd.get_world_size()))

    def _invalidate(self) -> None:
        self._group, self.process_set_id = None, None

    def size(self) -> Optional[int]:
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(nd.get_rank())

    def included(self) -> Optional[bool]:
        return None if self.process_set_id is None else nd.get_rank() in self.ranks

    def group(self, where: str) -> ProcessGroup:
        """The nccl_ddp group of this set (this rank must be a member)."""
        if self._group is None:
            raise ConfigError(
                f"{where}: process set {self.ranks or 'global'} is not registered; call hvd.init() "
                "first, and hvd.add_process_set(ranks) (on every rank) for a new set"
            )
        if isinstance(self._group, NonMemberGroup):
            raise ConfigError(
                f"rank {nd.get_rank()}: {where}: this rank is not in process set {self.ranks}; "
                "call it on the set's ranks only"
            )
        return self._group

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
_registered: List[ProcessSet] = []
_set_ids = itertools.count(1)


def add_process_set(process_set: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks); every rank calls it, in the
    same order (nccl_ddp.new_group)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ConfigError(f"hvd.add_process_set: {ps} is registered already")
    if any(p.ranks == ps.ranks for p in _registered) or ps.ranks == global_process_set.ranks:
        raise ConfigError(f"hvd.add_process_set: a process set with ranks {ps.ranks} exists already")
    ps._register(nd.new_group(ps.ranks), next(_set_ids))
    _registered.append(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    if process_set is global_process_set or process_set not in _registered:
        return False
    _registered.remove(process_set)
    process_set._invalidate()
    return True


def group_of(process_set: object, where: str) -> ProcessGroup:
    if not isinstance(process_set, ProcessSet):
        raise ConfigTypeError(
            f"{where}: process_set must be an hvd.ProcessSet (hvd.global_process_set or one from "
            f"hvd.add_process_set), got {type(process_set).__name__}"
        )
    return process_set.group(where)


def invalidate_all() -> None:
    """Forget every registered set and the global set's group (`hvd.shutdown`)."""
    for ps in list(_registered):
        ps._invalidate()
    _registered.clear()
    global_process_set._invalidate()
