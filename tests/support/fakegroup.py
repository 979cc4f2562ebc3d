"""An in-process ProcessGroup: N ranks as N threads of one process, for fast reducer unit tests.

`run_threads(fn, size, *args)` calls `fn(group, *args)` on `size` threads, each with its own
`FakeGroup`, and returns the results in rank order (the first exception is re-raised). Each group
records when its collectives start (`group.started`: (time.monotonic(), op name, nbytes)).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from nccl_ddp.comm.group import ProcessGroup, ReduceOp, Work
from nccl_ddp.device import HostStream


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots = [None] * size


class FakeWork(Work):
    def __init__(self, event, result) -> None:
        self._event, self._result = event, result

    def wait(self, timeout=None) -> bool:
        self._event.synchronize(timeout)
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def result(self):
        self.wait()
        return self._result


_OPS = {
    ReduceOp.SUM: np.sum,
    ReduceOp.AVG: np.sum,
    ReduceOp.MAX: np.max,
    ReduceOp.MIN: np.min,
    ReduceOp.PROD: np.prod,
}


class FakeGroup(ProcessGroup):
    backend = "host"

    def __init__(self, shared: _Shared, rank: int, size: int, timeout: float = 30.0) -> None:
        self._shared, self.rank, self.size, self.timeout = shared, rank, size, timeout
        self.ranks = tuple(range(size))
        self.name = "fake"
        self._stream = HostStream(f"fake-{rank}")
        self.started: list = []

    def _exchange(self, value):
        sh = self._shared
        sh.slots[self.rank] = value
        sh.barrier.wait()
        got = list(sh.slots)
        sh.barrier.wait()
        return got

    def _run(self, name, nbytes, fn, stream, result):
        def task():
            self.started.append((time.monotonic(), name, nbytes))
            fn()

        s = stream or self._stream
        s.submit(task)
        return FakeWork(s.record(), result)

    def all_reduce(self, buf, op=ReduceOp.SUM, stream=None, *, tag=None):
        op = ReduceOp.parse(op)

        def fn():
            stack = np.stack(self._exchange(buf.copy()))
            acc = stack.astype(np.float64) if stack.dtype.kind == "f" else stack
            red = _OPS[op](acc, axis=0)
            if op is ReduceOp.AVG:
                red = red / self.size
            buf[...] = red.astype(buf.dtype)

        return self._run("all_reduce", buf.nbytes, fn, stream, buf)

    def broadcast(self, buf, root=0, stream=None, *, tag=None):
        def fn():
            buf[...] = self._exchange(buf.copy())[root]

        return self._run("broadcast", buf.nbytes, fn, stream, buf)

    def all_gather(self, out, inp, stream=None, *, tag=None):
        def fn():
            out[...] = np.concatenate([x.reshape(-1) for x in self._exchange(inp.copy())])

        return self._run("all_gather", inp.nbytes, fn, stream, out)

    def reduce_scatter(self, out, inp, op=ReduceOp.SUM, stream=None, *, tag=None):
        raise NotImplementedError

    def barrier(self, stream=None, *, tag=None):
        return self._run("barrier", 0, lambda: self._exchange(None), stream, None)

    def new_subgroup(self, ranks):
        raise NotImplementedError

    def shutdown(self) -> None:
        self._stream.close()


def run_threads(fn, size, *args, timeout=60.0):
    shared = _Shared(size, timeout)
    groups = [FakeGroup(shared, r, size, timeout) for r in range(size)]
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(groups[r], *args)
        except BaseException as e:  # re-raised below
            errors[r] = e
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for g in groups:
        g.shutdown()
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks did not finish within {timeout}s")
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results
