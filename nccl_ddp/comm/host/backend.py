"""The "host" backend: real collectives between processes on NumPy arrays, no GPU needed.

Ranks of one node (the launcher's GROUP_RANK) use shared memory (`shm.ShmTransport`), groups over
nodes TCP rings (`ring.RingTransport`; `throttle.py`). NCCL_DDP_HOST_TRANSPORT=tcp forces TCP.
Each group runs its collectives in call order on one worker thread, like a CUDA stream, and
every call returns a `HostWork` at once; its errors name the op, its `tag` (what the buffer
is: "bucket 3 (1.0 MiB)"), the group and the rank. After a failure the group is broken: it tells
every peer why and ends its side of each connection (so peers fail fast, naming the cause,
instead of timing out), and every later call raises the same error.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from nccl_ddp.comm.group import ProcessGroup, ReduceOp, check_gather_buffers
from nccl_ddp.comm.host import hier, throttle
from nccl_ddp.comm.host.carrier import Carrier
from nccl_ddp.comm.host.fused import FusedSums
from nccl_ddp.comm.host.reduce import Reduction, dtype_code, make_reduction
from nccl_ddp.comm.host.rendezvous import Rendezvous, host_id
from nccl_ddp.comm.host.ring import RingTransport, SelfTransport
from nccl_ddp.comm.host.shared import shared_zeros
from nccl_ddp.comm.host.shm import SMALL_BYTES, ShmTransport
from nccl_ddp.comm.host.wire import ALL_GATHER, ALL_REDUCE, BARRIER, BROADCAST, REDUCE_SCATTER
from nccl_ddp.comm.host.work import HostWork
from nccl_ddp.device import DEFAULT_TIMEOUT, Device, ImmediateStream, Stream
from nccl_ddp.errors import CommError, ConfigError, NcclDdpError, RankMismatchError
from nccl_ddp.job.env import env_int, node_rank

log = logging.getLogger(__name__)

_REDOPS = list(ReduceOp)


def _flat(a: np.ndarray, what: str, writable: bool) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ConfigError(
            f"{what}: the host backend takes NumPy arrays, got {type(a).__name__}; "
            f"use nccl_ddp.all_reduce & co., which convert DLPack arrays"
        )
    if not a.flags.c_contiguous:
        raise ConfigError(f"{what}: buffer must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ConfigError(f"{what}: buffer is read-only")
    return a.reshape(-1)


class HostProcessGroup(FusedSums, ProcessGroup):
    """A group of ranks running host collectives; construction is collective over its members.

    `store` must be private to this group (e.g. a PrefixStore); `rank` is the group rank and
    `ranks` the members' global ranks in group-rank order (default range(size)).
    """

    backend = "host"

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        ranks: Optional[Sequence[int]] = None,
        timeout: float = DEFAULT_TIMEOUT,
        name: str = "world",
        *,
        transport: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        origin: str = "",
    ) -> None:
        self.rank, self.size, self.timeout, self.name = rank, size, float(timeout), name
        self._origin = origin  # where the group's size came from, named while awaiting ranks
        self.ranks = tuple(range(size) if ranks is None else ranks)
        if len(self.ranks) != size or not 0 <= rank < size:
            raise ConfigError(
                f"group {name!r}: rank {rank} / size {size} do not match the member list {list(self.ranks)}"
            )
        self._store = store
        self._where = f"group {name!r} (rank {self.ranks[rank]}, group rank {rank}/{size})"
        self._subgroups = itertools.count(1)
        self._seq = itertools.count(1)
        self._reductions: dict = {}  # (dtype, op, prescale) -> Reduction
        self._error: Optional[BaseException] = None
        self._closed = False
        self._transport = self._connect(
            transport or os.environ.get("NCCL_DDP_HOST_TRANSPORT", "auto"),
            int(chunk_bytes or env_int("NCCL_DDP_HOST_CHUNK_BYTES", 0)),  # 0: the transport's default
        )
        self._cv = threading.Condition()
        self._items: deque = deque()  # queued (work, fn, ready); None stops the worker
        self._running = False  # an op is executing (on the worker or inline)
        self._worker = threading.Thread(target=self._loop, name=f"nccl_ddp-host-{name}-{rank}", daemon=True)
        self._worker.start()

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        size: int,
        ranks: Sequence[int],
        timeout: float,
        name: str,
        origin: str = "",
    ) -> HostProcessGroup:
        return cls(store, rank, size, ranks, timeout, name, origin=origin)

    # -- setup ---------------------------------------------------------------------------------

    def _connect(
        self, transport: str, chunk_bytes: int
    ) -> Union[SelfTransport, ShmTransport, RingTransport, Carrier]:
        if transport not in ("auto", "shm", "tcp"):
            raise ConfigError(f"{self._where}: NCCL_DDP_HOST_TRANSPORT={transport!r}; use auto, shm or tcp")
        self._links: list = []
        if self.size == 1:
            self.transport_kind = "self"
            return SelfTransport()
        rdv = Rendezvous(
            self._store,
            self.rank,
            list(self.ranks),
            self.timeout,
            self._where,
            dict(
                host=host_id(),
                node=node_rank(),
                hier=hier.wanted(),
                transport=transport,
                chunk=chunk_bytes,
                members=list(self.ranks),
            ),
            origin=self._origin,
        )
        infos = rdv.infos
        for r, info in enumerate(infos):
            if info["members"] != list(self.ranks):
                rdv.listener.close()
                raise RankMismatchError(
                    f"{self._where}: this rank's group has members {list(self.ranks)} but group "
                    f"rank {r} (rank {info['members'][r]}) joined with members {info['members']}; "
                    f"every member must create the group from the same ranks"
                )
        chunk = infos[0]["chunk"]  # every rank must chunk alike
        nodes = [(i["host"], i["node"]) for i in infos]  # the launcher's nodes (2 on 1 host: no shm)
        same_host = len(set(nodes)) == 1
        if any(i["transport"] == "shm" for i in infos) and not same_host:
            rdv.listener.close()
            raise ConfigError(
                f"{self._where}: shm transport requested but the members run on "
                f"several hosts; use NCCL_DDP_HOST_TRANSPORT=auto or tcp"
            )
        t: Callable[[], Any]
        if same_host and all(i["transport"] != "tcp" for i in infos):
            links = rdv.connect(range(self.size))
            kind, t = "shm", lambda: ShmTransport(links, self.rank, self.size, chunk)
        else:  # the flat TCP ring, or the hierarchy over the nodes
            kind, links, t = hier.choose(rdv, infos, nodes, self.rank, self.size, chunk, self.timeout)
        self._links = list(links.values())
        for j, link in links.items():  # links between nodes: counted, and paced where asked
            link.cross_node = nodes[j] != nodes[self.rank]
            link.throttle = throttle.from_env() if link.cross_node else None
        try:
            out = t()
        except NcclDdpError as e:
            err: NcclDdpError = type(e)(f"{self._where}: setting up the {kind} transport failed: {e}")
            self._give_up_setup(err)
            raise err from e
        except OSError as e:
            err = CommError(
                f"{self._where}: setting up the {kind} transport failed ({e}); set "
                f"NCCL_DDP_HOST_TRANSPORT=tcp if /dev/shm is not shared"
            )
            self._give_up_setup(err)
            raise err from e
        log.debug("%s: %s transport, %d-byte chunks", self._where, kind, out.chunk)
        self.transport_kind = kind
        return out

    def _give_up_setup(self, err: BaseException) -> None:
        """Tell the peers why setup failed (their setup then fails with this reason, not with
        'peer closed the connection'), then close the links."""
        for link in self._links:
            link.abort(str(err))
        self._close_links()

    def _close_links(self) -> None:
        for link in self._links:
            link.close()

    # -- the worker ----------------------------------------------------------------------------

    def _submit(
        self, opname: str, tag: Optional[str], fn: Callable[[], None], result: Any, stream: Optional[Stream]
    ) -> HostWork:
        """Queue `fn` on the worker; with a stream, order it after the stream's submitted work
        and make the stream's later work wait for it:

            stream : ... work A | record(ready) ............ | wait(done) | work B ...
            worker :                   wait(ready) | collective | done

        The caller's own immediate stream (`HostDevice.current_stream()`, what the synchronous
        API passes) makes the op synchronous: it runs on the calling thread when the worker is
        idle (in order, and without two thread switches per small op), else it waits its turn.
        A DDP bucket's collective comes this way from the comm stream's thread (the second hop
        of a gradient, docs/architecture.md): it stays on that thread unless the worker is busy.
        """
        if self._closed:
            raise CommError(f"{self._where}: {self._on(opname, tag)} called after the group was shut down")
        work = HostWork(self._on(f"{opname} #{next(self._seq)}", tag), result, self.timeout)
        immediate = isinstance(stream, ImmediateStream)
        ready = stream.record() if stream is not None and not immediate else None
        with self._cv:
            inline = immediate and not self._running and not self._items
            if inline:
                self._running = True
            else:
                self._items.append((work, fn, ready))
                self._cv.notify()
        if inline:
            self._execute((work, fn, None))
        elif immediate:
            work.event.reached(self.timeout)  # errors surface in work.wait()
        elif stream is not None:
            stream.wait(work.event)
        return work

    def _take(self) -> Optional[tuple]:
        """Under the lock: the next item, marked running, or None while one runs or none is
        queued; () for the stop marker."""
        if self._running or not self._items:
            return None
        self._running = True
        return self._items.popleft() or ()

    def _loop(self) -> None:
        while True:
            with self._cv:
                item = self._take()
                while item is None:
                    self._cv.wait()
                    item = self._take()
            if item == ():
                return
            self._execute(item)

    def _execute(self, item: tuple) -> None:
        work, fn, ready = item
        try:
            if self._error is not None:
                work._finish(
                    type(self._error)(f"{work.what}: not run, the group failed earlier: {self._error}")
                )
                return
            try:
                if ready is not None:
                    ready.synchronize(self.timeout)
                with np.errstate(over="ignore", invalid="ignore"):  # wraps like NCCL, silently
                    fn()
                work._finish(None)
            except BaseException as e:  # handed to whoever waits on the work
                err = (type(e) if isinstance(e, NcclDdpError) else CommError)(f"{work.what} failed: {e}")
                err.__cause__ = e
                self._error = err
                log.error("%s", err)
                for link in self._links:  # peers blocked on us fail fast, with our reason
                    link.abort(str(err))
                work._finish(err)
        finally:
            with self._cv:
                self._running = False
                if self._items:
                    self._cv.notify()

    # -- collectives ---------------------------------------------------------------------------

    def _desc(
        self, what: str, op: int, a: np.ndarray, redop: Optional[ReduceOp] = None, root: int = 0
    ) -> tuple:
        return (op, dtype_code(a.dtype, what), _REDOPS.index(redop) if redop else 0, root, a.size)

    def _reduction(
        self, what: str, a: np.ndarray, op: Any, prescale: float = 1.0, wire: Any = None
    ) -> Reduction:
        key = (a.dtype, ReduceOp.parse(op), prescale, wire)  # (a DDP step: a few of them)
        if key not in self._reductions:
            self._reductions[key] = make_reduction(a.dtype, key[1], self.size, what, prescale, wire)
        return self._reductions[key]

    def zeros(self, device: Device, n: int, dtype: Any) -> Any:
        """On the shm transport, buffers over 64 KiB in shared memory of their own: an all-reduce
        whose buffers are all such reads the peers' in place (`ShmTransport.all_reduce`)."""
        if device.kind == "host" and isinstance(self._transport, ShmTransport):
            if n * np.dtype(dtype).itemsize > SMALL_BYTES:
                out = shared_zeros(n, dtype)
                if out is not None:
                    return out
        return device.zeros(n, dtype)

    def all_reduce(
        self,
        buf: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> HostWork:
        return self._all_reduce(buf, op, 1.0, stream, tag)

    def _all_reduce(
        self,
        buf: Any,
        op: Any,
        prescale: float,
        stream: Optional[Stream],
        tag: Optional[str],
        wire: Any = None,
    ) -> HostWork:
        what = self._on("all_reduce", tag)
        with self.checking("all_reduce"):
            flat = _flat(buf, what, True)
            red = self._reduction(what, flat, op, prescale, wire)
            desc = self._desc(what, ALL_REDUCE, flat, red.op)
        return self._submit(
            "all_reduce", tag, lambda: self._transport.all_reduce(flat, red, desc), buf, stream
        )

    def broadcast(
        self, buf: Any, root: int = 0, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> HostWork:
        what = self._on("broadcast", tag)
        with self.checking("broadcast"):
            flat = _flat(buf, what, True)
            if not 0 <= root < self.size:
                raise ConfigError(f"{what}: root {root} is not a group rank (0..{self.size - 1})")
            desc = self._desc(what, BROADCAST, flat, root=root)
        return self._submit(
            "broadcast", tag, lambda: self._transport.broadcast(flat, root, desc), buf, stream
        )

    def all_gather(
        self, out: Any, inp: Any, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> HostWork:
        what = self._on("all_gather", tag)
        with self.checking("all_gather"):
            o, i = _flat(out, what, True), _flat(inp, what, False)
            check_gather_buffers(what, self.size, o, i, "out", "input")
            desc = self._desc(what, ALL_GATHER, i)
        return self._submit("all_gather", tag, lambda: self._transport.all_gather(o, i, desc), out, stream)

    def gathers_in_parts(self, device: Device) -> bool:
        """On the host: the shm transport hands the peers' shared inputs themselves, the others
        views of a buffer gathered into (no saving there, but the same call)."""
        return device.kind == "host"

    def all_gather_parts(
        self,
        inp: Any,
        apply: Callable[[Sequence[Any]], None],
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> HostWork:
        what = self._on("all_gather", tag)
        with self.checking("all_gather"):
            i = _flat(inp, what, False)
            desc = self._desc(what, ALL_GATHER, i)
        transport, n = self._transport, i.size

        def run() -> None:
            if isinstance(transport, ShmTransport):
                transport.all_gather_parts(i, apply, desc)
                return
            out = np.empty(self.size * n, i.dtype)
            transport.all_gather(out, i, desc)
            apply([out[j * n : (j + 1) * n] for j in range(self.size)])

        return self._submit("all_gather", tag, run, None, stream)

    def reduce_scatter(
        self,
        out: Any,
        inp: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> HostWork:
        what = self._on("reduce_scatter", tag)
        with self.checking("reduce_scatter"):
            o, i = _flat(out, what, True), _flat(inp, what, False)
            check_gather_buffers(what, self.size, i, o, "input", "out")
            red = self._reduction(what, o, op)
            desc = self._desc(what, REDUCE_SCATTER, o, red.op)
        return self._submit(
            "reduce_scatter", tag, lambda: self._transport.reduce_scatter(o, i, red, desc), out, stream
        )

    def barrier(self, stream: Optional[Stream] = None, *, tag: Optional[str] = None) -> HostWork:
        desc = (BARRIER, 0, 0, 0, 0)
        return self._submit("barrier", tag, lambda: self._transport.barrier(desc), None, stream)

    def _on(self, op: str, tag: Optional[str]) -> str:
        """How messages name an op: "all_reduce #3 of bucket 2 (1.0 MiB) on group 'world' (...)"."""
        return f"{op} of {tag} on {self._where}" if tag else f"{op} on {self._where}"

    # -- groups --------------------------------------------------------------------------------

    def new_subgroup(self, ranks: Sequence[int]) -> Optional[HostProcessGroup]:
        """Collective over this group (every member calls it, in the same order)."""
        from nccl_ddp.store.client import PrefixStore

        n = next(self._subgroups)
        members = sorted(set(int(r) for r in ranks))
        bad = [r for r in members if r not in self.ranks]
        if bad or not members:
            raise ConfigError(
                f"new_group on {self._where}: ranks {bad or members} are not members "
                f"of this group ({list(self.ranks)})"
            )
        me = self.ranks[self.rank]
        if me not in members:
            return None
        name = f"group{members}" if self.name == "world" else f"{self.name}/group{members}"
        # keyed by the members too: ranks that disagree on them never share rendezvous keys
        keys = PrefixStore(self._store, f"sub{n}/{'-'.join(map(str, members))}")
        return HostProcessGroup(
            keys, members.index(me), len(members), members, self.timeout, name.replace(" ", "")
        )

    @property
    def failed(self) -> bool:
        return self._error is not None

    def cross_node_bytes(self) -> int:  # (sent so far to ranks on other nodes, headers included)
        return sum(link.sent for link in self._links if link.cross_node)

    def lost_peers(self) -> list:
        return sorted(link.peer for link in self._links if link.closed_by_peer())

    def poison(self, reason: str) -> None:
        """The group fails with `reason` here, and every peer linked to this rank fails with it
        at its next read (its pending collective, or its next one), then tells its own links:
        the reason reaches every member of a TCP ring too."""
        if self._error is None:
            self._error = CommError(reason)
            log.error("%s", reason)
        for link in self._links:
            link.abort(reason)

    def abort(self, reason: str) -> None:
        if self._error is None:
            self._error = CommError(f"{self._where}: aborted: {reason}")
        for link in self._links:  # peers blocked on us fail at once, with the reason
            link.abort(reason)

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._items.append(None)
            self._cv.notify_all()
        if not wait:  # (carried.py's, from a finalizer) the worker stops after its current op
            return
        self._worker.join(timeout=self.timeout)
        if self._worker.is_alive():  # stuck in a collective: unblock it by closing its sockets
            self._close_links()
            self._worker.join(timeout=5.0)
        self._transport.close()
        self._close_links()
