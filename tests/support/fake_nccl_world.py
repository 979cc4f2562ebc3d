"""Several ranks of the NCCL backend on one fake GPU (tests/support/_fake_cupy.py): each rank is a
thread with a real `NcclProcessGroup` whose runtime is `WorldRuntime` (CuPy's calls on the fake:
its streams and events) and whose communicator, `WorldComm`, moves the bytes between the ranks'
buffers in the fake heap the way ncclAllGather / ncclReduceScatter / ncclAllReduce define it,
once every rank has made the call (a rendezvous, bounded). The fake GPU runs each launch when it
is made, so a collective's inputs are final when its last rank arrives.

The ranks take turns: a rank runs only while it holds `World.gpu`, and gives it up only while it
waits inside a collective, so the fake CuPy's global state (its current stream and device) is
each rank's own; `World.log` records, in order, every collective (name, rank, stream), and
whatever the test appends (kernel launches, stream waits, event records)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
from _fake_cupy import FAKE_STATE, FakeEvent, FakeStream
from fake_nccl import DTYPES, NCCL_H, DictStore, FakeNcclError

from nccl_ddp.comm.nccl import backend as nb

CODE_DTYPE = {code: np.dtype(t) for t, code in DTYPES.items()}
SUM, AVG = NCCL_H["NCCL_SUM"], NCCL_H["NCCL_AVG"]


class World:
    """What the ranks share: the fake CuPy, the turn lock, the rendezvous and the log."""

    def __init__(self, cp, size: int, timeout: float = 20.0, log=None, gpu=None) -> None:
        self.cp, self.size, self.timeout = cp, size, timeout
        self.gpu = threading.Lock() if gpu is None else gpu  # one per fake GPU, shared by its groups
        self.barrier = threading.Barrier(size)
        self.posted: list = [None] * size
        self.log: list = [] if log is None else log

    def take_turn(self, saved: dict) -> None:
        """Hold the fake GPU again and restore this rank's CuPy state."""
        self.gpu.acquire()
        FAKE_STATE.update(saved)

    def give_turn(self) -> dict:
        saved = {"current": FAKE_STATE["current"], "device": FAKE_STATE["device"]}
        self.gpu.release()
        return saved


class WorldComm:
    """One rank's communicator: the collectives of nccl.h on the fake heap, run at the
    rendezvous of every rank (the same op, count and dtype, or FakeNcclError on every rank)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    def _collective(self, name, send, recv, count, dtype, op, stream):
        w = self.world
        w.log.append((name, self.rank, stream))
        saved = w.give_turn()
        try:
            w.posted[self.rank] = (name, send, recv, count, dtype, op)
            w.barrier.wait(w.timeout)  # every rank's inputs are final
            calls = {p[0::3] + p[4:] for p in w.posted}
            if len(calls) != 1:
                raise FakeNcclError(f"ranks disagree on the collective: {sorted(calls)}")
            with w.gpu:
                out = self._result(name, count, CODE_DTYPE[dtype], op)
            w.barrier.wait(w.timeout)  # every rank has read the inputs (in place: its output)
            with w.gpu:
                w.cp.heap.view(recv, out.size, out.dtype)[...] = out
        finally:
            w.take_turn(saved)

    def _result(self, name, count, dtype, op):
        """This rank's output, from every rank's input."""
        w, heap = self.world, self.world.cp.heap
        ins = [p[1] for p in w.posted]
        if name == "allGather":
            return np.concatenate([heap.view(send, count, dtype) for send in ins])
        lo = self.rank * count * dtype.itemsize if name == "reduceScatter" else 0
        total = sum(heap.view(send + lo, count, dtype).astype(np.float64) for send in ins)
        if op == AVG:
            total = total / w.size
        elif op != SUM:
            raise FakeNcclError(f"op {op} is not faked")
        return total.astype(dtype)

    def allGather(self, send, recv, count, dtype, stream):
        self._collective("allGather", send, recv, count, dtype, None, stream)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        self._collective("reduceScatter", send, recv, count, dtype, op, stream)

    def allReduce(self, send, recv, count, dtype, op, stream):
        assert send == recv, "in place only"
        self._collective("allReduce", send, recv, count, dtype, op, stream)

    def check_async_error(self):
        return None

    def abort(self):
        return None

    def destroy(self):
        return None


class WorldRuntime:
    """`CupyRuntime`'s calls on the fake CuPy: its streams, events that are reached when
    recorded (the fake GPU has run everything queued by then), raw stream waits logged."""

    errors = (FakeNcclError,)

    def __init__(self, world: World) -> None:
        self.world, self.cp = world, world.cp
        self.lib = SimpleNamespace(get_version=lambda: 23203, **NCCL_H)

    def new_stream(self):
        return FakeStream(non_blocking=True)

    def current_stream(self):
        return FAKE_STATE["current"].ptr

    def record(self, stream):
        ev = FakeEvent()
        ev.record(FakeStream(ptr=stream))
        ev.done = True
        return ev

    def wait(self, stream, event):
        self.world.log.append(("stream wait", stream, event.ptr))

    def query(self, event):
        return event.done

    def ptr(self, buf):
        return buf.data.ptr

    def scratch(self):
        return self.cp.zeros(1, np.float32)

    def bind_thread(self):
        return None


def _group(world: World, rank: int, timeout: float, name: str):
    return nb.NcclProcessGroup(
        WorldComm(world, rank),
        WorldRuntime(world),
        rank=rank,
        size=world.size,
        ranks=range(world.size),
        timeout=timeout,
        name=name,
        store=DictStore(),
        poll=0.01,
    )


def _run(worlds, n: int, make_groups, fn, timeout: float) -> list:
    """`fn(rank, *make_groups(rank))` on `n` threads taking turns on the worlds' one GPU lock;
    the results by rank. The first error is raised here (the peers' rendezvous fail fast)."""
    results, errors = [None] * n, []
    turn = worlds[0]

    def body(rank: int) -> None:
        turn.take_turn({"current": FakeStream(null=True), "device": 0})
        groups: list = []
        try:
            groups = make_groups(rank)
            results[rank] = fn(rank, *groups)
        except BaseException as e:  # reported by the caller
            errors.append(e)
            for w in worlds:
                w.barrier.abort()
        finally:
            for g in groups:
                g.shutdown()
            turn.give_turn()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results


def run_world(cp, size: int, fn, timeout: float = 60.0, log=None) -> tuple:
    """`fn(rank, group)` on `size` threads, each with its own `NcclProcessGroup` over one
    `World` (logging into `log`); returns (the results by rank, the world)."""
    world = World(cp, size, log=log)
    return _run([world], size, lambda r: [_group(world, r, timeout, "world")], fn, timeout), world


def run_mesh(cp, rows: int, cols: int, fn, timeout: float = 60.0) -> list:
    """HSDP's 2-D mesh on `rows * cols` threads: `fn(rank, shard, replicate)`, `shard` the
    group of rank's row (cols ranks), `replicate` the group of its column (rows ranks), all on
    one fake GPU; the results by global rank (row-major)."""
    gpu = threading.Lock()
    shard = [World(cp, cols, gpu=gpu) for _ in range(rows)]
    replicate = [World(cp, rows, gpu=gpu) for _ in range(cols)]

    def groups(rank: int) -> list:
        r, c = divmod(rank, cols)
        return [
            _group(shard[r], c, timeout, f"shard {r}"),
            _group(replicate[c], r, timeout, f"replicate {c}"),
        ]

    return _run(shard + replicate, rows * cols, groups, fn, timeout)
