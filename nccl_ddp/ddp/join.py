"""Uneven inputs: `Join`, torch.distributed.algorithms.Join's protocol over our reducers.

    with nd.Join([ddp_model]):          # or: with ddp_model.join():
        for batch in my_batches:        # some ranks have fewer
            ...

Each step of a rank still training opens with a small all-reduce: 1 from it, 0 from the ranks
that have run out of data (`notify_join_context`). A rank that leaves the block loops in
`__exit__`: it all-reduces 0 with the others' notification; while the sum is not 0, every
joinable's `main_hook` shadows one step of the ranks still training (the same collectives, with
zeros), and once it is 0 the `post_hook`s run (DDP copies the parameters of the last rank to
join to every rank). DDP then divides the grads by the group size
(`divide_by_initial_world_size=True`, torch's default) or by the ranks still training.

A rank that raises inside the block writes its error to the store and aborts its group, so the
other ranks fail at once (or at their collective timeout on NCCL) with `JoinError` naming it,
instead of waiting for a collective that never comes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from types import TracebackType
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from nccl_ddp.buckets.memory import to_host
from nccl_ddp.comm.api import device_of
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.errors import CommError, ConfigError, ConfigTypeError, JoinError, NcclDdpError, StoreError
from nccl_ddp.validate import check_bool

log = logging.getLogger(__name__)

PEER_ERROR_WAIT_S = 3.0
"""How long a rank whose collective failed inside a Join looks for a peer's error report."""
_REPORT = re.compile(r"rank \d+ raised \w+ inside nccl_ddp\.Join: [^\n]*")


@dataclasses.dataclass(frozen=True)
class JoinConfig:
    """What a joinable needs to know while a `Join` is active (torch's `_JoinConfig`)."""

    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class JoinHook:
    """What a joined rank runs: `main_hook()` once per step of the ranks still training,
    `post_hook(is_last_joiner)` once everyone has joined."""

    def main_hook(self) -> None:
        """Shadow one step's collectives."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Called on every rank once all have joined."""


@dataclasses.dataclass
class JoinState:
    """A joinable's side of Join: `config` is set by `Join` on entry and reset on exit;
    `divide_by_initial` by its hook (`divide_by_initial_world_size`)."""

    config: JoinConfig = JoinConfig()
    divide_by_initial: bool = True


@runtime_checkable
class Joinable(Protocol):
    """An object whose per-step collectives a joined rank can shadow (DDP, DistributedGradReducer;
    torch's `Joinable`). A protocol, not a base class, so that framework wrappers subclass only
    their framework's module class."""

    join_state: JoinState

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs; `kwargs` are those given to `Join`."""

    @property
    def join_process_group(self) -> ProcessGroup:
        """The group the joinable's collectives run on."""


class Shadowing(Joinable, Protocol):
    """A joinable that `ShadowJoinHook` drives."""

    def join_shadow_step(self) -> None:
        """A joined rank's stand-in for one step of the ranks still training: the same
        collectives, in the same order, on zeros."""

    def join_finished(self, is_last_joiner: bool) -> None:
        """Every rank has joined (called on every rank)."""


def our_group(joinable: Joinable) -> ProcessGroup:
    """The nccl_ddp group a joinable's collectives run on: `join_process_group`, unless it
    names ours in `nccl_ddp_join_group` (the torch wrapper answers `join_process_group` with
    torch's group, for torch's Join)."""
    own = getattr(joinable, "nccl_ddp_join_group", None)
    return own if own is not None else joinable.join_process_group


class Join:
    """Context manager for training with uneven inputs across ranks (see the module doc).

    `joinables`: the DDP wrappers / grad reducers used inside, sharing one process group;
    `enable=False` makes it a no-op; `throw_on_early_termination=True` raises `JoinError` on
    every rank as soon as one runs out of data. Other keyword arguments go to each joinable's
    `join_hook` (DDP: `divide_by_initial_world_size=True`)."""

    def __init__(
        self,
        joinables: Sequence[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(joinables, (list, tuple)) or not joinables:
            raise ConfigTypeError(
                "Join: joinables must be a non-empty list of DistributedDataParallel"
                f" / DistributedGradReducer objects, got {joinables!r:.80}"
            )
        for i, j in enumerate(joinables):
            if not isinstance(j, Joinable):
                raise ConfigTypeError(
                    f"Join: joinables[{i}] is a {type(j).__name__}, not a "
                    "Joinable (DistributedDataParallel, DistributedGradReducer)"
                )
        check_bool("enable", enable)
        check_bool("throw_on_early_termination", throw_on_early_termination)
        groups = {id(our_group(j)) for j in joinables}
        if len(groups) > 1:
            raise ConfigError(
                "Join: the joinables use different process groups; one Join "
                "handles the collectives of one group"
            )
        self._joinables = list(joinables)
        self._enable = enable
        self._throw = throw_on_early_termination
        self._join_hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._group = our_group(self._joinables[0])
        self._key = ""

    def __enter__(self) -> Join:
        for i, j in enumerate(self._joinables):
            j.join_state.config = JoinConfig(self._enable, self._throw, i == 0)
        if self._enable:
            self._key = f"nccl_ddp/join/{self._group.name}/{next(_count(self._group.name))}"
        return self

    def __exit__(
        self, typ: Optional[type], value: Optional[BaseException], tb: Optional[TracebackType]
    ) -> Optional[bool]:
        try:
            if not self._enable:
                return None
            if value is not None:
                self._on_error(value)
                return None
            try:
                self._join()
            except Exception as e:
                self._on_error(e)
                raise
            return None
        finally:
            for j in self._joinables:
                j.join_state.config = JoinConfig()

    def _join(self) -> None:
        is_last_joiner = True
        rounds = 0
        while True:
            nonjoined, _ = exchange(self._group, [0, 1 if self._throw else 0], "Join's count")
            if nonjoined == 0:
                break
            if self._throw:
                raise JoinError(
                    f"rank {self._group.rank} exhausted all inputs (throw_on_early_termination=True)"
                )
            for hook in self._join_hooks:
                hook.main_hook()
            is_last_joiner = False
            rounds += 1
            if rounds == 1000:
                log.warning(
                    "rank %d has at least 1000 fewer inputs than another rank still "
                    "training; uneven inputs this skewed waste that many steps' time",
                    self._group.rank,
                )
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    # ------------------------------------------------------------------ failures

    def _on_error(self, error: BaseException) -> None:
        """An error inside the block or the join loop. A failed collective may be the echo of a
        peer's error: then raise `JoinError` naming that peer. Otherwise the error is this rank's
        own: report it and abort the group so that the peers stop waiting for us."""
        store = _store()
        if isinstance(error, CommError):
            peer = self._peer_error(store, error)
            if peer is not None:
                raise JoinError(f"rank {self._group.rank}: leaving Join because {peer}") from error
            return
        if isinstance(error, JoinError):
            return
        rank = self._group.rank
        text = f"rank {rank} raised {type(error).__name__} inside nccl_ddp.Join: {error}"
        if store is not None:
            try:
                n = store.add(f"{self._key}/failures", 1)
                store.set(f"{self._key}/error{n}", text.encode()[:4096])
            except StoreError as e:
                log.warning("rank %d: could not report the error to the store: %s", rank, e)
        log.error("%s; aborting the process group so that the other ranks stop waiting", text)
        self._group.abort(text)

    def _peer_error(self, store: Any, error: BaseException) -> Optional[str]:
        """A peer's report: in the failed collective's message (the host backend carries the
        abort reason), else in the store (NCCL; the peer may be gone, and the store with it)."""
        e: Optional[BaseException] = error
        while e is not None:
            found = _REPORT.search(str(e))
            if found:
                return found.group(0)
            e = e.__cause__
        if store is None:
            return None
        try:
            return store.get(f"{self._key}/error1", timeout=PEER_ERROR_WAIT_S).decode(errors="replace")
        except StoreError:
            return None

    # ------------------------------------------------------------------ per step

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Optional[int]:
        """Called by a joinable at the start of each step while it trains: returns how many ranks
        are still training (None unless the joinable is the first of an enabled Join). With
        throw_on_early_termination, raises `JoinError` once any rank has run out of inputs."""
        cfg = joinable.join_state.config
        if not (cfg.enable and cfg.is_first_joinable):
            return None
        group = our_group(joinable)
        active, stop = exchange(group, [1, 0], "Join's count")
        if stop:
            raise JoinError(
                f"rank {group.rank}: detected at least one rank that exhausted its "
                "inputs (throw_on_early_termination=True); throwing on every rank"
            )
        return active


def exchange(group: ProcessGroup, values: List[int], tag: str, op: ReduceOp = ReduceOp.SUM) -> List[int]:
    """A small int32 all-reduce of `values`, in the caller's stream order; the reduced values."""
    device = device_of(group)
    buf = device.xp.asarray(np.asarray(values, dtype=np.int32))
    group.all_reduce(buf, op, stream=device.current_stream(), tag=tag).wait(group.timeout)
    return [int(v) for v in to_host(buf)]


_counters: Dict[str, Iterator[int]] = {}


def _count(name: str) -> Iterator[int]:
    return _counters.setdefault(name, itertools.count(1))


def _store() -> Any:
    from nccl_ddp.comm import api

    try:
        return api.get_store()
    except NcclDdpError:
        return None


class ShadowJoinHook(JoinHook):
    """The hook of DDP and DistributedGradReducer: a joined rank shadows each step of the ranks
    still training (`join_shadow_step`), then `join_finished` runs on every rank. Takes Join's
    `divide_by_initial_world_size` (True: the ranks still training divide by the group's size,
    as torch does; False: by their own number)."""

    def __init__(self, joinable: Shadowing, owner: str, kwargs: Dict[str, Any]) -> None:
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise ConfigError(
                f"Join: unknown keyword arguments {sorted(unknown)} for {owner} (it "
                "takes divide_by_initial_world_size)"
            )
        divide = kwargs.get("divide_by_initial_world_size", True)
        check_bool("divide_by_initial_world_size", divide)
        self.joinable = joinable
        joinable.join_state.divide_by_initial = divide

    def main_hook(self) -> None:
        self.joinable.join_shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.join_finished(is_last_joiner)
