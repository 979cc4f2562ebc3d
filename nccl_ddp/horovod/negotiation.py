"""Horovod's matching of collectives (the role of horovod/common/controller.cc): every op of the
facade is a named request queued on its process set; before any data moves, the members exchange
their pending requests (one small all-gather; a second only for long lists), run the ops that
every member has submitted, in one order, and refuse mismatched ones on every rank.

So ops are matched by `name=` (unnamed ones by `<op>.noname.<n>`, counted per process set),
ranks may issue them in different orders, a name already pending is refused (ValueError, as
Horovod's), and a mismatch that every rank sees leaves the group usable: no data moved. A rank
inside `hvd.join()` takes part in the allreduces of the others with zeros. Ops run when some
rank waits on one (`synchronize`, or any blocking op), so `poll` is False until then.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import nccl_ddp as nd
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import CommTimeout, ConfigError, NcclDdpError
from nccl_ddp.horovod.arrays import NativeArray, host, xp_of
from nccl_ddp.horovod.requests import JOINABLE, Records, Request, decode, dtype_code, mismatch

log = logging.getLogger(__name__)

FIXED = 64  # int64 words per rank in a round's first all-gather
STALL_WARNING = 60.0  # seconds before a waiting op names the ranks that have not submitted it


@dataclass
class Entry:
    """A submitted op: its request, what runs it once matched, and its outcome."""

    request: Request
    run: Callable[[Records], object]
    where: str
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: Optional[BaseException] = None


# what a joined rank runs for an op of the others it did not submit (zeros into an allreduce)
JoinedRunner = Callable[[ProcessGroup, Request], None]
joined_runners: Dict[str, JoinedRunner] = {}


class Queue:
    """The pending ops of one process set on this rank, and the rounds that match them."""

    def __init__(self, group: ProcessGroup, label: str) -> None:
        self.group, self.label = group, label
        self.pending: Dict[int, Entry] = {}  # by key, in submission order
        self.names: Dict[int, str] = {}
        self.counters: Dict[str, int] = {}
        self.joined: List[int] = []  # group ranks in the order they joined
        self.missing: Dict[int, List[int]] = {}  # key -> global ranks that lack it (last round)
        self.lock = threading.Lock()  # one round at a time
        self.submit_lock = threading.Lock()

    def auto_name(self, op: str) -> str:
        n = self.counters.get(op, 0)
        self.counters[op] = n + 1
        return f"{op}.noname.{n}"

    def submit(self, request: Request, run: Callable[[Records], object], where: str) -> Entry:
        with self.submit_lock:
            if request.key in self.pending:
                raise ConfigError(
                    f"rank {nd.get_rank()}: {where}: Requested to allreduce, allgather, or broadcast "
                    f"a tensor with the same name as another tensor that is currently being "
                    f"processed ({request.name!r}); synchronize the first, or give another name="
                )
            entry = Entry(request, run, where)
            self.names[request.key] = request.name
            self.pending[request.key] = entry
            return entry

    def wait(self, entry: Entry) -> object:
        """Run rounds until `entry` is done; its result, or its error raised."""
        start = time.monotonic()
        warn_at, idle = start + STALL_WARNING, 0
        while not entry.done.is_set():
            if self.lock.acquire(timeout=0.05):
                try:
                    if not entry.done.is_set():
                        ran = self._round()
                        idle = 0 if ran else idle + 1
                        if not ran:
                            time.sleep(min(0.05, 0.0002 * 2 ** min(idle, 8)))
                finally:
                    self.lock.release()
            now = time.monotonic()
            if not entry.done.is_set() and now > warn_at:
                log.warning("%s", self._stalled(entry, now - start))
                warn_at = now + STALL_WARNING
            if not entry.done.is_set() and now - start > self.group.timeout:
                self._fail(entry, CommTimeout(self._stalled(entry, now - start)))
        if entry.error is not None:
            raise entry.error
        return entry.result

    def _stalled(self, entry: Entry, waited: float) -> str:
        lacking = self.missing.get(entry.request.key, "unknown")
        return (
            f"rank {nd.get_rank()}: {entry.where} ({entry.request.name!r}) on {self.label} waited "
            f"{waited:.0f}s: ranks {lacking} have not submitted it (Horovod's stall); every member "
            "must call the same ops with the same names"
        )

    def _fail(self, entry: Entry, error: BaseException) -> None:
        with self.submit_lock:
            self.pending.pop(entry.request.key, None)
        entry.error = error
        entry.done.set()

    def fail_all(self, why: str) -> None:
        for entry in list(self.pending.values()):
            self._fail(entry, ConfigError(f"{entry.where}: {why}"))

    # -- one round ---------------------------------------------------------------------------

    def _payload(self) -> Tuple[np.ndarray, List[Entry]]:
        with self.submit_lock:
            entries = list(self.pending.values())
        joined = any(e.request.kind == "JOIN" for e in entries)
        words: List[int] = [int(joined), len(entries)]
        for e in entries:
            words += e.request.encode()
        return np.asarray(words, np.int64), entries

    def _exchange(self, payload: np.ndarray) -> List[np.ndarray]:
        g = self.group
        xp = xp_of(g)
        first = np.zeros(FIXED, np.int64)
        first[0] = payload.size
        first[1 : 1 + min(payload.size, FIXED - 1)] = payload[: FIXED - 1]
        out = xp.zeros((g.size, FIXED), np.int64)
        nd.all_gather(out, xp.asarray(first), group=g)
        heads = host(out)
        lengths = [int(n) for n in heads[:, 0]]
        if max(lengths) <= FIXED - 1:
            return [heads[i, 1 : 1 + n] for i, n in enumerate(lengths)]
        whole = xp.zeros((g.size, max(lengths)), np.int64)
        mine = np.zeros(max(lengths), np.int64)
        mine[: payload.size] = payload
        nd.all_gather(whole, xp.asarray(mine), group=g)
        everything = host(whole)
        return [everything[i, :n] for i, n in enumerate(lengths)]

    def _round(self) -> int:
        """One exchange of pending requests, then every op all members have; returns how many ran."""
        payload, _ = self._payload()
        views = self._exchange(payload)
        g = self.group
        joined_now: List[bool] = []
        by_rank: List[Dict[int, Request]] = []
        for words in views:
            joined_now.append(bool(words[0]))
            reqs: Dict[int, Request] = {}
            at = 2
            for _ in range(int(words[1])):
                req, at = decode(words, at, self.names)
                reqs[req.key] = req
            by_rank.append(reqs)
        self.joined += [i for i in range(g.size) if joined_now[i] and i not in self.joined]
        active = [i for i in range(g.size) if not joined_now[i]]
        order = list(by_rank[active[0]]) if active else list(by_rank[0])
        ran = 0
        for key in order:
            have = [i for i in range(g.size) if key in by_rank[i]]
            if any(i not in have for i in active):
                self.missing[key] = [g.ranks[i] for i in active if i not in have]
                continue
            if self._run(key, [by_rank[i].get(key) for i in range(g.size)], joined_now):
                ran += 1
        return ran

    def _run(self, key: int, records: Records, joined_now: List[bool]) -> bool:
        present = [r for r in records if r is not None]
        kind, result = present[0].kind, None
        if kind == "JOIN" and not all(joined_now):
            return False  # join completes once every member joined
        with self.submit_lock:
            entry = self.pending.pop(key, None)
        self.missing.pop(key, None)
        where = entry.where if entry is not None else f"hvd.{kind.lower()}"
        problem = mismatch(records, self.group, where)
        if problem is None and kind not in JOINABLE and any(joined_now):
            joined = [self.group.ranks[i] for i, j in enumerate(joined_now) if j]
            problem = ConfigError(
                f"rank {nd.get_rank()}: {where}: {kind.capitalize()} is not supported with Join at "
                f"this time (ranks {joined} called hvd.join()); only allreduce may run while a rank "
                "has joined"
            )
        if kind == "JOIN":
            result = self.group.ranks[self.joined[-1]]
            self.joined = []
        if entry is None:  # a joined rank: zeros into the others' allreduce
            if problem is None and kind in joined_runners:
                joined_runners[kind](self.group, present[0])
            return True
        if problem is not None:
            entry.error = problem
        elif kind != "JOIN":
            try:
                result = entry.run(records)
            except NcclDdpError as e:  # the data collective failed: the group is poisoned
                entry.error = e
        if entry.error is None:
            entry.result = result
        entry.done.set()
        return True


# -- the queues of this process -------------------------------------------------------------

_queues: Dict[int, Queue] = {}
_queues_lock = threading.Lock()


def queue_of(group: ProcessGroup) -> Queue:
    with _queues_lock:
        q = _queues.get(id(group))
        if q is None or q.group is not group:
            q = _queues[id(group)] = Queue(group, group.name)
        return q


def reset(why: str) -> None:
    """Forget every queue (`hvd.shutdown`); ops still pending fail with `why`."""
    with _queues_lock:
        queues = list(_queues.values())
        _queues.clear()
    for q in queues:
        q.fail_all(why)


def submit(
    group: ProcessGroup,
    kind: str,
    name: Optional[str],
    run: Callable[[Records], object],
    where: str,
    *,
    array: Optional[NativeArray] = None,
    **fields: object,
) -> Entry:
    """Queue an op on `group`'s members (dtype and shape from `array` unless given)."""
    q = queue_of(group)
    if array is not None:
        fields.setdefault("dtype", dtype_code(array.dtype))
        fields.setdefault("shape", tuple(int(d) for d in array.shape))
    full = name if name else q.auto_name(kind.lower())
    request = Request(kind, full, **fields)  # type: ignore[arg-type]
    return q.submit(request, run, where)


def wait(group: ProcessGroup, entry: Entry) -> object:
    return queue_of(group).wait(entry)


def barrier(group: ProcessGroup, where: str = "hvd.barrier") -> None:
    """Every member reached it (matched with the others' ops, as Horovod's barrier)."""
    wait(group, submit(group, "BARRIER", None, lambda _: nd.barrier(group=group), where))


def join(group: ProcessGroup, where: str = "hvd.join") -> int:
    """Horovod's join: until every member has joined, this rank's zeros take part in the others'
    allreduces; returns the global rank that joined last."""
    out = wait(group, submit(group, "JOIN", None, lambda _: None, where))
    assert isinstance(out, int)
    return out


joined_runners["BARRIER"] = lambda group, _: nd.barrier(group=group)


__all__ = ["Entry", "Queue", "reset", "submit", "wait"]
