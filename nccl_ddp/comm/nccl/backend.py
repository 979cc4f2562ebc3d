"""The "nccl" backend: a `ProcessGroup` over CuPy's NCCL bindings, guarded by a watchdog thread.

Streams (`stream=None`: the group's own non-blocking comm stream):

    caller:  ──[writes buf]──●ready                         ┌─wait(done)──[reads buf]   Work.wait()
    comm:                    └─wait(ready)──[nccl op]──●done┘

Nothing blocks the host: `Work.wait()` makes the caller's stream wait on the op's done-event.
The watchdog polls `ncclCommGetAsyncError` and the done-event of every op in flight; on an error,
or an op older than the group's timeout, it aborts the communicator, and the next call from the
training thread (any collective, `Work.wait`) raises `CommError` / `CommTimeout` naming the op,
the bucket tag, the group and the rank.

The watchdog, poisoning and the serialized abort are `GroupWatchdog` (nccl/watchdog.py).

Beyond the ProcessGroup interface: every collective takes `tag=` ("bucket 3") for error messages,
`Work.wait(stream=...)` orders another stream than CuPy's current one, and
`Work.synchronize(timeout)` blocks the host (tests, shutdown). Buffers are contiguous CuPy arrays;
`stream` is anything with a `.ptr` (device.CudaStream, cupy.cuda.Stream) or `__cuda_stream__`.

Every CUDA/NCCL call goes through a small runtime object (`CupyRuntime`) so that tests can swap
in a fake one on a machine without a GPU. CuPy is imported lazily: this module needs only NumPy.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from nccl_ddp.comm.desync import DesyncChecker, check_distinct_devices
from nccl_ddp.comm.group import ProcessGroup, ReduceOp, Work, check_gather_buffers
from nccl_ddp.comm.nccl.runtime import (
    ADVICE,
    CupyRuntime,
    bounded,
    check,
    is_available,
    nccl_dtype,
    nccl_op,
    stream_ptr,
)
from nccl_ddp.comm.nccl.watchdog import GroupWatchdog
from nccl_ddp.device import Stream
from nccl_ddp.errors import CommError, CommTimeout, ConfigError, StoreTimeout

__all__ = ["NcclProcessGroup", "NcclWork", "exchange_unique_id", "is_available", "nccl_dtype", "nccl_op"]

WATCHDOG_POLL = 0.05  # seconds between watchdog checks
UNIQUE_ID_BYTES = 128
_generations: dict = {}  # (name, ranks) -> groups created so far, for unique store keys


def exchange_unique_id(
    store: Any, key: str, rank: int, timeout: float, make_id: Callable[[], bytes], who: str
) -> bytes:
    """Group rank 0 makes the NCCL unique id and publishes it under `key`; the others fetch it."""
    if rank == 0:
        uid = bytes(make_id())
        store.set(key, uid)
        return uid
    try:
        uid = bytes(store.get(key, timeout))
    except StoreTimeout as e:
        raise CommTimeout(
            f"{who}: group rank 0 did not publish the NCCL unique id ({key!r}) "
            f"within {timeout:g}s; check that every member creates the group, and "
            f"read rank 0's log"
        ) from e
    if len(uid) != UNIQUE_ID_BYTES:
        raise CommError(
            f"{who}: the NCCL unique id under {key!r} has {len(uid)} bytes, not "
            f"{UNIQUE_ID_BYTES}; another job may share this store (MASTER_PORT)"
        )
    return uid


class NcclWork(Work):
    """One collective in flight: its done-event, its output, and the buffers it keeps alive."""

    def __init__(self, group: NcclProcessGroup, what: str, event: Any, output: Any, keep: tuple) -> None:
        self.what, self.event, self.output = what, event, output
        self.started = time.monotonic()
        self._group, self._keep = group, keep

    def wait(self, timeout: Optional[float] = None, stream: Optional[Stream] = None) -> bool:
        """Make `stream` (None: CuPy's current stream) wait for the op; never blocks the host.

        `timeout` is not used here: the watchdog bounds every op by the group's timeout, and the
        next call after it fires raises."""
        g = self._group
        g._raise_if_failed(f"Work.wait of {self.what}")
        with check(g._rt.errors, f"Work.wait of {self.what}"):
            g._rt.wait(g._rt.current_stream() if stream is None else stream_ptr(stream), self.event)
        return True

    def is_completed(self) -> bool:
        g = self._group
        if g._failure is not None:
            return True
        with check(g._rt.errors, f"query of {self.what}"):
            return bool(g._rt.query(self.event))

    def result(self) -> Any:
        self.wait()
        return self.output

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until the op finished (tests, shutdown); CommTimeout after `timeout`."""
        g = self._group
        limit = g.timeout if timeout is None else timeout
        deadline, delay = time.monotonic() + limit, 1e-4
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"NCCL {self.what} did not complete within {limit:g}s (host synchronize). {ADVICE}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        g._raise_if_failed(f"synchronize of {self.what}")


class NcclProcessGroup(GroupWatchdog, ProcessGroup):
    """A NCCL communicator, its comm stream and its watchdog. Build it with `create`."""

    backend = "nccl"

    def __init__(
        self,
        comm: Any,
        runtime: Any,
        *,
        rank: int,
        size: int,
        ranks: Sequence[int],
        timeout: float,
        name: str,
        device_id: int = 0,
        store: Any = None,
        poll: float = WATCHDOG_POLL,
    ) -> None:
        self.rank, self.size, self.ranks = rank, size, tuple(ranks)
        self.timeout, self.name, self.device_id = float(timeout), name, device_id
        self._comm, self._rt, self._store, self._poll = comm, runtime, store, poll
        with check(runtime.errors, f"comm stream creation of group {name!r}"):
            self._stream = runtime.new_stream()
        self._pending: list = []
        self._lock = threading.Lock()  # _pending and _released
        self._comm_lock = threading.Lock()  # every use of the communicator (watchdog.py)
        self._abort_due = False  # an abort waits for the call holding _comm_lock
        self._failure: Optional[tuple] = None  # (class, message, cause) set by the watchdog
        self._closed = False
        self._released = False  # communicator destroyed or aborted
        self._scratch = None  # barrier's 1-element buffer
        self._stop = threading.Event()
        self._next_probe = 0.0  # when the watchdog may next look for a peer's poison notice
        self._desync = DesyncChecker.maybe(store, rank, self.ranks, name, self.timeout)
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name=f"nccl_ddp-watchdog:{name}")
        self._watchdog.start()

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        size: int,
        ranks: Sequence[int],
        timeout: float,
        name: str,
        device_id: int,
        *,
        runtime: Any = None,
    ) -> NcclProcessGroup:
        """Collective over the members: exchange the unique id through `store` and build the
        communicator on `device_id`. `runtime` replaces the CuPy calls (tests)."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) != size or not 0 <= rank < size:
            raise ConfigError(
                f"NCCL group {name!r}: rank {rank} and size {size} do not fit the member list {list(ranks)}"
            )
        rt = runtime if runtime is not None else CupyRuntime(device_id)
        gen = _generations[(name, ranks)] = _generations.get((name, ranks), 0) + 1
        key = f"nccl_ddp/nccl_uid/{name}/{','.join(map(str, ranks))}/{gen}"
        who = f"rank {ranks[rank]} (group {name!r} rank {rank}/{size})"
        if size > 1:  # two ranks on one GPU: a clear error before NCCL gives an obscure one
            with check(rt.errors, f"GPU query of {who}, GPU {device_id}"):
                uuid = getattr(rt, "device_uuid", lambda: None)()
            check_distinct_devices(store, rank, ranks, name, timeout, device_id, uuid)
        uid = exchange_unique_id(store, key, rank, timeout, rt.unique_id, who)
        what = f"communicator init of group {name!r} on {who}, GPU {device_id}"
        with check(rt.errors, what):
            comm = bounded(lambda: rt.new_comm(size, uid, rank), timeout, f"NCCL {what}")
        return cls(
            comm,
            rt,
            rank=rank,
            size=size,
            ranks=ranks,
            timeout=timeout,
            name=name,
            device_id=device_id,
            store=store,
        )

    # ------------------------------------------------------------------ collectives

    def all_reduce(
        self,
        buf: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> NcclWork:
        dt, code, p = self._dtype(buf), nccl_op(op, self._rt.lib), self._rt.ptr(buf)
        self._debug_check("all_reduce", buf, redop=ReduceOp.parse(op))
        return self._launch(
            "all_reduce", tag, stream, buf, (buf,), lambda c, s: c.allReduce(p, p, buf.size, dt, code, s)
        )

    def broadcast(
        self, buf: Any, root: int = 0, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> NcclWork:
        if not 0 <= root < self.size:
            raise ConfigError(
                f"broadcast root {root} is not a rank of group {self.name!r} "
                f"(size {self.size}); pass a group rank"
            )
        dt, p = self._dtype(buf, reduce=False), self._rt.ptr(buf)
        self._debug_check("broadcast", buf, root=root)
        return self._launch(
            "broadcast", tag, stream, buf, (buf,), lambda c, s: c.broadcast(p, p, buf.size, dt, root, s)
        )

    def all_gather(
        self, out: Any, inp: Any, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> NcclWork:
        self._check_sizes("all_gather", tag, out, inp, "out", "input", reduce=False)
        dt, pi, po = self._dtype(inp, reduce=False), self._rt.ptr(inp), self._rt.ptr(out)
        self._debug_check("all_gather", inp)
        return self._launch(
            "all_gather", tag, stream, out, (out, inp), lambda c, s: c.allGather(pi, po, inp.size, dt, s)
        )

    def reduce_scatter(
        self,
        out: Any,
        inp: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> NcclWork:
        self._check_sizes("reduce_scatter", tag, inp, out, "input", "out")
        dt, code = self._dtype(inp), nccl_op(op, self._rt.lib)
        pi, po = self._rt.ptr(inp), self._rt.ptr(out)
        self._debug_check("reduce_scatter", out, redop=ReduceOp.parse(op))
        return self._launch(
            "reduce_scatter",
            tag,
            stream,
            out,
            (out, inp),
            lambda c, s: c.reduceScatter(pi, po, out.size, dt, code, s),
        )

    def barrier(self, stream: Optional[Stream] = None, *, tag: Optional[str] = None) -> NcclWork:
        """A 1-element all-reduce; returns once every rank reached it (the host blocks, bounded
        by the group's timeout: CommTimeout)."""
        if self._scratch is None:
            self._scratch = self._rt.scratch()
        buf = self._scratch
        dt, code, p = self._dtype(buf), nccl_op("sum", self._rt.lib), self._rt.ptr(buf)
        self._debug_check("barrier", None)
        work = self._launch(
            "barrier", tag, stream, None, (buf,), lambda c, s: c.allReduce(p, p, 1, dt, code, s)
        )
        work.synchronize()
        return work

    def _debug_check(self, op: str, buf: Any, root: int = 0, redop: Any = None) -> None:
        """NCCL_DDP_DEBUG=DETAIL: compare this collective with every member's (comm/desync.py)."""
        if self._desync is not None:
            self._raise_if_failed(self._describe(op, None))
            self._desync.check(
                op, None if buf is None else buf.dtype, 0 if buf is None else buf.size, root, redop
            )

    def _dtype(self, buf: Any, reduce: bool = True) -> int:
        """NCCL type of `buf`, which must be contiguous (NCCL sees a pointer and a count);
        `reduce=False` where bits only move (runtime.nccl_dtype)."""
        if not buf.flags.c_contiguous:
            raise ConfigError(
                f"NCCL buffers must be contiguous; got a strided {buf.dtype} array of "
                f"shape {buf.shape} on group {self.name!r} (pass a contiguous copy)"
            )
        return nccl_dtype(buf.dtype, self._rt.lib, reduce)

    def _check_sizes(
        self,
        op: str,
        tag: Optional[str],
        big: Any,
        small: Any,
        big_name: str,
        small_name: str,
        reduce: bool = True,
    ) -> None:
        self._dtype(big, reduce)
        check_gather_buffers(self._describe(op, tag), self.size, big, small, big_name, small_name)

    def _describe(self, op: str, tag: Optional[str]) -> str:
        label = f"{op} ({tag})" if tag else op
        return (
            f"{label} on group {self.name!r}, rank {self.rank} of {self.size} "
            f"(global rank {self.ranks[self.rank]})"
        )

    def _launch(
        self,
        op: str,
        tag: Optional[str],
        stream: Optional[Stream],
        output: Any,
        keep: tuple,
        call: Callable[[Any, int], None],
    ) -> NcclWork:
        what = self._describe(op, tag)
        self._raise_if_failed(what)
        with self._using_comm(what), check(self._rt.errors, what):
            if stream is None:
                # caller: ──[writes buf]──●ready
                # comm:                   └─wait──[nccl op]──●done
                s = self._stream.ptr
                self._rt.wait(s, self._rt.record(self._rt.current_stream()))
            else:
                s = stream_ptr(stream)
            call(self._comm, s)
            event = self._rt.record(s)
        self._raise_if_failed(what)  # the watchdog failed the group during the call
        work = NcclWork(self, what, event, output, keep)
        with self._lock:
            self._pending.append(work)
        return work

    # ------------------------------------------------------------------ groups

    def new_subgroup(self, ranks: Sequence[int]) -> Optional[NcclProcessGroup]:
        """Collective over this group: ncclCommSplit where CuPy binds it, else a new unique id
        through the store. Call it with no collective in flight."""
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.ranks):
            raise ConfigError(
                f"new_subgroup{list(ranks)}: ranks must be distinct members of group "
                f"{self.name!r} {list(self.ranks)}"
            )
        me = self.ranks[self.rank]
        member = me in ranks
        name = f"group{list(ranks)}"
        what = self._describe(f"new_subgroup {name}", None)
        self._raise_if_failed(what)
        if hasattr(self._comm, "commSplit"):

            def split() -> Any:
                with self._using_comm(what):
                    return self._comm.commSplit(0 if member else -1, ranks.index(me) if member else 0)

            with check(self._rt.errors, what):
                comm = bounded(split, self.timeout, f"NCCL {what}")
            if not member:
                return None
            return NcclProcessGroup(
                comm,
                self._rt,
                rank=ranks.index(me),
                size=len(ranks),
                ranks=ranks,
                timeout=self.timeout,
                name=name,
                device_id=self.device_id,
                store=self._store,
                poll=self._poll,
            )
        if not member:
            return None
        return NcclProcessGroup.create(
            self._store,
            ranks.index(me),
            len(ranks),
            ranks,
            self.timeout,
            name,
            self.device_id,
            runtime=self._rt,
        )

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def shutdown(self) -> None:
        """Stop the watchdog; destroy the communicator, or abort it if ops are still in flight."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._watchdog.join(timeout=max(1.0, 10 * self._poll))
        problem = self._failure or self._poll_once(time.monotonic())
        self._release(abort=problem is not None or bool(self._pending))
