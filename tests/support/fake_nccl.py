"""A fake NCCL for the NCCL backend's logic on any machine: `FakeRuntime` stands in for
`CupyRuntime` (streams are ints, events complete when told), `FakeComm` records the NCCL calls,
`make_group` builds an `NcclProcessGroup` of world size 1 over them."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.nccl import backend as nb

# ncclDataType_t / ncclRedOp_t values from nccl.h
NCCL_H = dict(
    NCCL_INT8=0,
    NCCL_UINT8=1,
    NCCL_INT32=2,
    NCCL_UINT32=3,
    NCCL_INT64=4,
    NCCL_UINT64=5,
    NCCL_FLOAT16=6,
    NCCL_FLOAT32=7,
    NCCL_FLOAT64=8,
    NCCL_BFLOAT16=9,
    NCCL_SUM=0,
    NCCL_PROD=1,
    NCCL_MAX=2,
    NCCL_MIN=3,
    NCCL_AVG=4,
)
DTYPES = {
    np.int8: 0,
    np.uint8: 1,
    np.int32: 2,
    np.uint32: 3,
    np.int64: 4,
    np.uint64: 5,
    np.float16: 6,
    np.float32: 7,
    np.float64: 8,
    ml_dtypes.bfloat16: 9,
}
OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
COMM_STREAM, CURRENT_STREAM = 1000, 1


class FakeNcclError(RuntimeError):
    pass


class FakeEvent:
    def __init__(self, done: bool):
        self.done = done


class FakeComm:
    """Records the NCCL calls; `async_error` is what check_async_error raises. Like CuPy's
    NcclCommunicator, each call runs with the GIL released (`gate`, when set, holds the caller
    inside the call until it is set) and `abort` frees the communicator before zeroing the
    handle: an abort while a call is inside is a use after free (`freed_under`)."""

    def __init__(self):
        self.calls, self.async_error = [], None
        self.aborted = self.destroyed = False
        self.gate, self.inside, self.order, self.freed_under = None, 0, [], []

    def _call(self, name, a):
        self.inside += 1
        self.order.append(("enter", name, threading.current_thread().name))
        try:
            if self.gate is not None:
                assert self.gate.wait(10), "gate never opened"
            self.calls.append((name,) + a)
        finally:
            self.order.append(("leave", name, threading.current_thread().name))
            self.inside -= 1

    def allReduce(self, *a):
        self._call("allReduce", a)

    def broadcast(self, *a):
        self._call("broadcast", a)

    def allGather(self, *a):
        self._call("allGather", a)

    def reduceScatter(self, *a):
        self._call("reduceScatter", a)

    def check_async_error(self):
        if self.async_error is not None:
            raise self.async_error

    def abort(self):
        self.order.append(("abort", threading.current_thread().name))
        if self.inside:
            self.freed_under.append(self.order[-2])
        self.aborted = True

    def destroy(self):
        if self.inside:
            self.freed_under.append(self.order[-1])
        self.destroyed = True


class SplitComm(FakeComm):
    def commSplit(self, color, key):
        self.calls.append(("commSplit", color, key))
        return None if color == -1 else SplitComm()


class FakeRuntime:
    """Stands in for `CupyRuntime`: streams are ints, events complete when `complete` says."""

    errors = (FakeNcclError,)

    def __init__(self, complete=True, comm_cls=FakeComm, version=23203, block_init=None):
        self.complete, self.comm_cls, self.block_init = complete, comm_cls, block_init
        self.lib = SimpleNamespace(get_version=lambda: version, **NCCL_H)
        self.calls, self.comms, self.uids = [], [], []

    def unique_id(self):
        return os.urandom(128)

    def new_comm(self, size, uid, rank):
        if self.block_init is not None:
            self.block_init.wait(30)
        self.uids.append(uid)
        self.comms.append(self.comm_cls())
        return self.comms[-1]

    def new_stream(self):
        return SimpleNamespace(ptr=COMM_STREAM)

    def current_stream(self):
        return CURRENT_STREAM

    def record(self, stream):
        ev = FakeEvent(self.complete)
        self.calls.append(("record", stream, ev))
        return ev

    def wait(self, stream, event):
        self.calls.append(("wait", stream, event))

    def query(self, event):
        return event.done

    def ptr(self, buf):
        return buf.ctypes.data

    def scratch(self):
        return np.zeros(1, np.float32)

    def bind_thread(self):
        pass


class DictStore:
    def __init__(self):
        self.d = {}

    def set(self, key, value):
        self.d[key] = bytes(value)

    def get(self, key, timeout=None):
        return self.d[key]


def make_group(rt=None, timeout=30.0, rank=0, size=1, ranks=None, poll=0.01, name="world"):
    rt = rt or FakeRuntime()
    comm = rt.new_comm(size, b"x" * 128, rank)
    return (
        nb.NcclProcessGroup(
            comm,
            rt,
            rank=rank,
            size=size,
            ranks=ranks or range(size),
            timeout=timeout,
            name=name,
            store=DictStore(),
            poll=poll,
        ),
        comm,
        rt,
    )


def wait_for(pred, limit=5.0):
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
