"""The NCCL backend: its logic against a fake communicator/runtime (any machine), and real NCCL at
world size 1 (`gpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from fake_nccl import (
    COMM_STREAM,
    CURRENT_STREAM,
    DTYPES,
    OPS,
    DictStore,
    FakeNcclError,
    FakeRuntime,
    SplitComm,
    make_group,
    wait_for,
)
from gpu_probe import HAS_GPU
from mp import run_ranks

from nccl_ddp.comm.nccl import backend as nb
from nccl_ddp.comm.nccl import watchdog as nw
from nccl_ddp.errors import CommError, CommTimeout, ConfigError

# ---------------------------------------------------------------------------------- mapping


def test_import_loads_no_cupy():
    code = "import sys, nccl_ddp.comm.nccl; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU answer")
def test_is_available_false_without_gpu():
    assert nb.is_available() is False


@pytest.mark.parametrize("dtype,code", DTYPES.items(), ids=lambda v: getattr(v, "__name__", v))
def test_dtype_mapping(dtype, code):
    lib = FakeRuntime().lib
    assert nb.nccl_dtype(np.dtype(dtype), lib) == code


def test_float8_needs_nccl_2_24_and_others_refused():
    assert nb.nccl_dtype(np.dtype(ml_dtypes.float8_e4m3fn), FakeRuntime().lib) == 10
    assert nb.nccl_dtype(np.dtype(ml_dtypes.float8_e5m2), FakeRuntime().lib) == 11
    with pytest.raises(TypeError, match="float8 needs NCCL >= 2.24"):
        nb.nccl_dtype(np.dtype(ml_dtypes.float8_e5m2), FakeRuntime(version=22305).lib)
    for bad in (np.complex64, np.bool_, np.int16):
        with pytest.raises(TypeError, match="NCCL cannot reduce dtype"):
            nb.nccl_dtype(np.dtype(bad), FakeRuntime().lib)


def test_dtypes_without_an_nccl_type_move_as_the_unsigned_type_of_their_size():
    lib = FakeRuntime().lib
    for dt, code in ((np.bool_, lib.NCCL_UINT8), (np.int16, lib.NCCL_FLOAT16), (np.uint16, lib.NCCL_FLOAT16)):
        assert nb.nccl_dtype(np.dtype(dt), lib, reduce=False) == code
        with pytest.raises(TypeError, match="NCCL cannot reduce dtype"):
            nb.nccl_dtype(np.dtype(dt), lib)
    with pytest.raises(TypeError, match="NCCL cannot reduce dtype"):
        nb.nccl_dtype(np.dtype(np.complex128), lib, reduce=False)  # 16 bytes: no such type


def test_op_mapping():
    lib = FakeRuntime().lib
    for op, code in OPS.items():
        assert nb.nccl_op(op, lib) == code
        assert nb.nccl_op(op.value.upper(), lib) == code
    with pytest.raises(ValueError, match="unknown reduce op"):
        nb.nccl_op("mean", lib)


def test_cupy_constants_match_nccl_h():
    """Our tables read CuPy's names; check they carry nccl.h's values in the installed CuPy."""
    pytest.importorskip("cupy")
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("NCCL library not loadable (pip install nvidia-nccl-cu12)")
    for dtype, code in DTYPES.items():
        assert nb.nccl_dtype(np.dtype(dtype), nccl) == code
    for op, code in OPS.items():
        assert nb.nccl_op(op, nccl) == code


# ---------------------------------------------------------------------------------- launch


def test_all_reduce_orders_on_comm_stream_and_wait_does_not_block():
    g, comm, rt = make_group()
    x = np.arange(6, dtype=np.float32)
    w = g.all_reduce(x, "avg", tag="bucket 0")
    # the comm stream waits for an event of the caller's stream, the op runs there, then records
    (r1, s1, ready), (w1, s2, ev1), (r2, s3, done) = rt.calls
    assert (r1, s1, w1, s2, ev1, r2, s3) == (
        "record",
        CURRENT_STREAM,
        "wait",
        COMM_STREAM,
        ready,
        "record",
        COMM_STREAM,
    )
    assert comm.calls == [("allReduce", x.ctypes.data, x.ctypes.data, 6, 7, 4, COMM_STREAM)]
    assert w.wait() is True
    assert rt.calls[-1] == ("wait", CURRENT_STREAM, done)
    assert w.result() is x and w.is_completed()
    g.shutdown()


def test_given_stream_is_used_as_is():
    g, comm, rt = make_group()
    x = np.zeros(3, np.int64)
    g.broadcast(x, root=0, stream=SimpleNamespace(ptr=77))
    assert comm.calls == [("broadcast", x.ctypes.data, x.ctypes.data, 3, 4, 0, 77)]
    assert [c[:2] for c in rt.calls] == [("record", 77)]
    w = g.barrier(stream=SimpleNamespace(__cuda_stream__=lambda: (0, 55)))
    assert comm.calls[-1][0] == "allReduce" and comm.calls[-1][3:] == (1, 7, 0, 55)
    assert w.result() is None
    g.shutdown()


def test_all_gather_and_reduce_scatter_shapes():
    g, comm, _ = make_group(size=2, rank=1)
    inp, out = np.ones(4, np.float16), np.zeros(8, np.float16)
    g.all_gather(out, inp)
    g.reduce_scatter(inp, out, op="max")
    assert comm.calls[0] == ("allGather", inp.ctypes.data, out.ctypes.data, 4, 6, COMM_STREAM)
    assert comm.calls[1] == ("reduceScatter", out.ctypes.data, inp.ctypes.data, 4, 6, 2, COMM_STREAM)
    with pytest.raises(
        ValueError,
        match=r"all_gather on group 'world', rank 1 of 2 .*: out must "
        r"hold group size \(2\) x input elements; got out 7, "
        r"input 4",
    ):
        g.all_gather(np.zeros(7, np.float16), inp)
    with pytest.raises(ValueError, match="input is float16 but out is float32; use one dtype"):
        g.reduce_scatter(np.zeros(4, np.float32), out)
    with pytest.raises(ValueError, match="root 2 is not a rank"):
        g.broadcast(inp, root=2)
    with pytest.raises(ValueError, match="must be contiguous"):
        g.all_reduce(out[::2])
    g.shutdown()


def test_nccl_error_on_launch_becomes_comm_error():
    g, comm, _ = make_group()

    def boom(*a):
        raise FakeNcclError("NCCL_ERROR_INVALID_USAGE")

    comm.allReduce = boom
    with pytest.raises(
        CommError, match="all_reduce .bucket 2. on group 'world'.*INVALID_USAGE.*NCCL_DEBUG=INFO"
    ) as e:
        g.all_reduce(np.zeros(2, np.float32), tag="bucket 2")
    assert isinstance(e.value.__cause__, FakeNcclError)
    g.shutdown()


# ---------------------------------------------------------------------------------- watchdog


def test_watchdog_async_error_aborts_and_next_call_raises():
    g, comm, rt = make_group(size=4, rank=2, ranks=[0, 1, 2, 3])
    rt.complete = False  # the op stays in flight, so the error names it
    g.all_reduce(np.zeros(2, np.float32), tag="bucket 5")
    comm.async_error = FakeNcclError("NCCL_ERROR_REMOTE_ERROR")
    wait_for(lambda: comm.aborted)
    with pytest.raises(CommError) as e:
        g.broadcast(np.zeros(2, np.float32))
    msg = str(e.value)
    for part in (
        "asynchronous error",
        "all_reduce (bucket 5)",
        "group 'world'",
        "rank 2 of 4",
        "REMOTE_ERROR",
        "NCCL_DEBUG=INFO",
        "other ranks' logs",
        "raised at broadcast",
    ):
        assert part in msg
    assert not isinstance(e.value, CommTimeout)
    assert isinstance(e.value.__cause__, FakeNcclError)
    n = len(comm.calls)
    with pytest.raises(CommError):
        g.all_reduce(np.zeros(2, np.float32))
    assert len(comm.calls) == n  # nothing reached the aborted communicator
    g.shutdown()
    assert not comm.destroyed


def _call_held_inside_nccl(g, comm):
    """Start an all_reduce on another thread and hold it inside the NCCL call (GIL released)."""
    comm.gate = threading.Event()
    box = {}

    def train():
        try:
            box["work"] = g.all_reduce(np.zeros(2, np.float32), tag="bucket 1")
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=train, name="train")
    t.start()
    wait_for(lambda: comm.inside)
    return t, box


@pytest.mark.parametrize("held", [0.3, 1.5])
def test_watchdog_abort_waits_for_the_nccl_call_in_progress(monkeypatch, held):
    """Defect 1 of issue 23: the watchdog's abort must not free the communicator under a call of
    the training thread. Held less than ABORT_LOCK_WAIT, the abort comes after the call (from
    whichever thread takes the lock first); held longer, the watchdog hands it to the training
    thread, which aborts on its way out of the call."""
    monkeypatch.setattr(nw, "ABORT_LOCK_WAIT", 0.8)
    g, comm, rt = make_group(size=2, ranks=[0, 1])
    t, box = _call_held_inside_nccl(g, comm)
    comm.async_error = FakeNcclError("NCCL_ERROR_REMOTE_ERROR")
    wait_for(lambda: g.failed)
    time.sleep(held)
    assert not comm.aborted and comm.inside == 1  # still waiting for the call
    comm.gate.set()
    t.join(10)
    wait_for(lambda: comm.aborted)
    assert comm.freed_under == []
    assert comm.order[:2] == [("enter", "allReduce", "train"), ("leave", "allReduce", "train")]
    assert len(comm.order) == 3 and comm.order[2][0] == "abort"
    if held > 0.8:  # handed over: nobody else could have aborted
        assert comm.order[2] == ("abort", "train")
    assert isinstance(box.get("error"), CommError)  # the op went to a failed communicator
    assert "asynchronous error" in str(box["error"]) and "REMOTE_ERROR" in str(box["error"])
    with pytest.raises(CommError):
        g.all_reduce(np.zeros(2, np.float32))
    assert len(comm.calls) == 1
    g.shutdown()
    assert not comm.destroyed


def test_a_call_never_returning_bounds_the_next_one():
    """A thread stuck inside NCCL holds the communicator: another call gets CommTimeout after the
    group's timeout instead of waiting for it forever."""
    g, comm, _ = make_group(timeout=0.3)
    t, _ = _call_held_inside_nccl(g, comm)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="earlier NCCL call on group 'world' has not returned"):
        g.broadcast(np.zeros(2, np.float32))
    assert time.monotonic() - t0 < 20
    comm.gate.set()
    t.join(10)
    g.shutdown()
    assert comm.freed_under == [] and comm.destroyed


def test_watchdog_timeout_names_op_bucket_and_rank():
    g, comm, _ = make_group(
        FakeRuntime(complete=False), timeout=0.2, size=2, rank=1, ranks=[3, 5], name="group[3, 5]"
    )
    w = g.all_reduce(np.zeros(8, np.float32), tag="bucket 3")
    assert not w.is_completed()
    wait_for(lambda: comm.aborted)
    assert w.is_completed()
    with pytest.raises(CommTimeout) as e:
        w.wait()
    msg = str(e.value)
    for part in (
        "all_reduce (bucket 3)",
        "group 'group[3, 5]'",
        "rank 1 of 2",
        "global rank 5",
        "did not complete within 0.2s",
        "aborted",
        "NCCL_DEBUG=INFO",
    ):
        assert part in msg
    with pytest.raises(CommTimeout, match="raised at all_gather"):
        g.all_gather(np.zeros(4, np.float32), np.zeros(2, np.float32))
    g.shutdown()


def test_finished_ops_leave_the_watchdog_and_synchronize_times_out():
    g, _, rt = make_group(timeout=60)
    g.all_reduce(np.zeros(2, np.float32))
    wait_for(lambda: not g._pending)
    rt.complete = False
    w = g.all_reduce(np.zeros(2, np.float32))
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="host synchronize"):
        w.synchronize(timeout=0.1)
    assert time.monotonic() - t0 < 30  # not the group's 60 s
    w.event.done = True
    w.synchronize(timeout=1)
    g.shutdown()


def test_shutdown_destroys_idle_aborts_busy_and_is_final():
    g, comm, _ = make_group()
    g.all_reduce(np.zeros(2, np.float32))
    g.shutdown()
    g.shutdown()
    assert comm.destroyed and not comm.aborted
    assert not g._watchdog.is_alive()
    with pytest.raises(CommError, match="shut down"):
        g.all_reduce(np.zeros(2, np.float32))
    g2, comm2, _ = make_group(FakeRuntime(complete=False))
    g2.all_reduce(np.zeros(2, np.float32))
    g2.shutdown()
    assert comm2.aborted and not comm2.destroyed


# ---------------------------------------------------------------------------------- creation


def test_init_that_never_finishes_times_out():
    never = threading.Event()
    rt = FakeRuntime(block_init=never)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="communicator init of group 'world'.*within 0.3s"):
        nb.NcclProcessGroup.create(DictStore(), 0, 1, [0], 0.3, "world", 0, runtime=rt)
    assert time.monotonic() - t0 < 20  # bounded by the 0.3 s timeout, not hanging
    never.set()


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU failure")
def test_real_create_without_gpu_raises_comm_error():
    pytest.importorskip("cupy")
    with pytest.raises(CommError, match="communicator init of group 'world'.*GPU 0") as e:
        nb.NcclProcessGroup.create(DictStore(), 0, 1, [0], 5, "world", 0)
    assert e.value.__cause__ is not None


def test_create_checks_rank_and_size():
    with pytest.raises(ConfigError, match="rank 2 and size 2 do not fit"):
        nb.NcclProcessGroup.create(DictStore(), 2, 2, [0, 1], 5, "world", 0, runtime=FakeRuntime())


def test_new_subgroup_uses_comm_split():
    g, comm, rt = make_group(FakeRuntime(comm_cls=SplitComm), size=3, rank=1, ranks=[0, 1, 2])
    sub = g.new_subgroup([2, 1])
    assert comm.calls[-1] == ("commSplit", 0, 1)
    assert (sub.rank, sub.size, sub.ranks, sub.name) == (1, 2, (2, 1), "group[2, 1]")
    assert g.new_subgroup([0, 2]) is None
    assert comm.calls[-1] == ("commSplit", -1, 0)
    with pytest.raises(ValueError, match="distinct members"):
        g.new_subgroup([1, 7])
    sub.shutdown()
    g.shutdown()


def test_new_subgroup_without_split_exchanges_a_new_id():
    g, comm, rt = make_group(size=2, rank=0, ranks=[0, 1])
    sub = g.new_subgroup([0])
    assert sub.size == 1 and sub.ranks == (0,)
    ((key, uid),) = g._store.d.items()
    assert key.startswith("nccl_ddp/nccl_uid/group[0]/0/") and rt.uids[-1] == uid
    sub.shutdown()
    g.shutdown()


def _uid_rank(rank, world):
    """Two groups through a real TCPStore; returns the unique ids this rank's comms were built with."""
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import connect_store

    store = connect_store(resolve_env(), timeout=30)
    rt = FakeRuntime()
    try:
        from cupy.cuda import nccl  # real unique ids when the library loads (no GPU needed)

        if nccl.available:
            rt.unique_id = nccl.get_unique_id
    except ImportError:
        pass
    try:
        groups = [
            nb.NcclProcessGroup.create(store, rank, world, range(world), 30, "world", 0, runtime=rt)
            for _ in range(2)
        ]
        for g in groups:
            g.shutdown()
        store.barrier("done", world, timeout=30)
        return [u.hex() for u in rt.uids]
    finally:
        store.close()


@pytest.mark.slow
def test_unique_id_exchange_through_store_two_processes():
    a, b = run_ranks(_uid_rank, 2, timeout=90)
    assert a == b and len(a) == 2 and a[0] != a[1]
    assert all(len(bytes.fromhex(u)) == 128 for u in a)


# ---------------------------------------------------------------------------------- real NCCL


@pytest.fixture
def real_group():
    cp = pytest.importorskip("cupy")
    g = nb.NcclProcessGroup.create(DictStore(), 0, 1, [0], 60, "world", 0)
    yield g, cp
    g.shutdown()


def _device_array(cp, values, dtype):
    try:
        return cp.asarray(np.asarray(values).astype(dtype))
    except (TypeError, ValueError, NotImplementedError) as e:
        pytest.skip(f"CuPy cannot hold {np.dtype(dtype)}: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda v: v.__name__)
def test_real_collectives_world_size_1(real_group, dtype):
    g, cp = real_group
    ref = (np.arange(12) % 7).astype(dtype)
    ops = ["sum", "max", "min", "prod"] + (["avg"] if np.dtype(dtype).kind == "f" else [])
    for op in ops:
        x = _device_array(cp, ref, dtype)
        g.all_reduce(x, op).synchronize()
        np.testing.assert_array_equal(cp.asnumpy(x), ref)
    x = _device_array(cp, ref, dtype)
    g.broadcast(x, root=0).synchronize()
    np.testing.assert_array_equal(cp.asnumpy(x), ref)
    out = _device_array(cp, np.zeros(12), dtype)
    g.all_gather(out, _device_array(cp, ref, dtype)).synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), ref)
    out = _device_array(cp, np.zeros(12), dtype)
    g.reduce_scatter(out, _device_array(cp, ref, dtype), op="sum").synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), ref)
    g.barrier().synchronize()


_SPIN = r"""
extern "C" __global__ void spin_fill(float* x, int n, long long cycles, float v) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}"""


@pytest.mark.gpu
def test_real_stream_ordering_without_host_sync(real_group):
    """A slow producer on stream A, the collective on the comm stream, the reader on stream B:
    only the events order them; any missing wait shows up as zeros."""
    g, cp = real_group
    spin = cp.RawKernel(_SPIN, "spin_fill")
    n = 1 << 16
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(n, cp.float32)
    cp.cuda.Device().synchronize()
    with a:
        spin(((n + 255) // 256,), (256,), (x, np.int32(n), np.int64(200_000_000), np.float32(3)))
        w = g.all_reduce(x, "avg", tag="bucket 0")  # comm stream waits for A's work
    w.wait(stream=b)  # B waits for the collective
    with b:
        y = x * 2
    b.synchronize()
    assert float(y.min()) == 6.0 and float(y.max()) == 6.0
    # the same through an explicit stream the caller ordered itself
    c = cp.cuda.Stream(non_blocking=True)
    with a:
        spin(((n + 255) // 256,), (256,), (x, np.int32(n), np.int64(200_000_000), np.float32(5)))
        ready = a.record()
    c.wait_event(ready)
    w = g.all_reduce(x, stream=c)
    with b:
        w.wait()  # current stream is B here
        y = x + 1
    b.synchronize()
    assert float(y.min()) == 6.0 and float(y.max()) == 6.0


def test_barrier_blocks_the_host_until_every_rank_reached_it():
    """barrier() returns only once the collective completed; a stuck one raises CommTimeout
    after the group's timeout (it used to return at once)."""
    g, comm, rt = make_group(rt=FakeRuntime(complete=False), timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="barrier"):
        g.barrier()
    assert time.monotonic() - t0 >= 0.3
    g.shutdown()
    g, comm, rt = make_group()
    assert g.barrier().is_completed()
    g.shutdown()


def test_cupy_runtime_query_reports_cuda_errors_instead_of_not_done():
    """cudaEventQuery: 0 done, 600 (cudaErrorNotReady) pending, anything else raises (CuPy's
    Event.done would read a faulted kernel as pending until the timeout)."""
    from nccl_ddp.comm.nccl.runtime import CupyRuntime

    class CudaError(RuntimeError):
        def __init__(self, status):
            super().__init__(f"cudaErrorIllegalAddress ({status})")

    status = {}
    rt = CupyRuntime.__new__(CupyRuntime)
    rt.cupy = SimpleNamespace(
        cuda=SimpleNamespace(
            runtime=SimpleNamespace(eventQuery=lambda ptr: status[ptr], CUDARuntimeError=CudaError)
        )
    )
    status.update({1: 0, 2: 600, 3: 700})
    assert rt.query(SimpleNamespace(ptr=1)) is True
    assert rt.query(SimpleNamespace(ptr=2)) is False
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
        rt.query(SimpleNamespace(ptr=3))


def test_watchdog_reports_a_faulted_kernel_as_an_error_not_a_timeout():
    rt = FakeRuntime(complete=False)

    def query(event):
        if getattr(event, "faulted", False):
            raise FakeNcclError("cudaErrorIllegalAddress: an illegal memory access")
        return event.done

    rt.query = query
    g, comm, _ = make_group(rt=rt, timeout=30.0)
    w = g.all_reduce(np.zeros(4, np.float32))
    w.event.faulted = True
    deadline = time.monotonic() + 10
    while not g.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CommError, match="failed on the GPU: cudaErrorIllegalAddress"):
        w.wait()
    g.shutdown()


# ---------------------------------------------------------------------------------- blocking init


class CupyLikeNccl:
    """cupy.cuda.nccl as CuPy 14.2 binds NCCL (cupy_backends/cuda/libs/nccl.pyx): NCCL reads
    NCCL_COMM_BLOCKING once, at the process's first communicator; non-blocking, init returns
    ncclInProgress (7) and NcclError(7) raises KeyError from its name table (ERROR2 stops at 6)."""

    ERROR2 = {
        0: "NCCL_ERROR_SUCCESS",
        1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
        2: "NCCL_ERROR_SYSTEM_ERROR",
        3: "NCCL_ERROR_INTERNAL_ERROR",
        4: "NCCL_ERROR_INVALID_ARGUMENT",
        5: "NCCL_ERROR_INVALID_USAGE",
        6: "NCCL_ERROR_REMOTE_ERROR",
    }

    def __init__(self):
        self.blocking = None  # NCCL's cached ncclParamCommBlocking()
        lib = self

        class NcclError(RuntimeError):
            def __init__(self, status):
                super().__init__(f"{lib.ERROR2[status]}: ...")

        class NcclCommunicator:
            def __init__(self, ndev, uid, rank):
                if lib.blocking is None:
                    lib.blocking = os.environ.get("NCCL_COMM_BLOCKING", "1") != "0"
                if not lib.blocking:
                    raise NcclError(7)

        self.NcclError, self.NcclCommunicator = NcclError, NcclCommunicator


class _Device:
    def __init__(self, i):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def use(self):
        pass


def _cupy_runtime(lib):
    from nccl_ddp.comm.nccl.runtime import CupyRuntime

    rt = CupyRuntime.__new__(CupyRuntime)
    rt.cupy = SimpleNamespace(
        cuda=SimpleNamespace(Device=_Device, Stream=lambda non_blocking: SimpleNamespace(ptr=COMM_STREAM))
    )
    rt.lib, rt.device_id, rt.errors = lib, 0, (lib.NcclError,)
    rt.unique_id = lambda: b"u" * 128
    return rt


def test_nccl_comm_blocking_0_is_overridden_before_init(monkeypatch, caplog):
    """Defect 3 of issue 23: NCCL_COMM_BLOCKING=0 made init raise KeyError: 7 out of CuPy."""
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    lib = CupyLikeNccl()
    g = nb.NcclProcessGroup.create(DictStore(), 0, 1, [0], 5, "world", 0, runtime=_cupy_runtime(lib))
    assert os.environ["NCCL_COMM_BLOCKING"] == "1" and lib.blocking is True
    assert "NCCL_COMM_BLOCKING=0 replaced by 1" in caplog.text
    g._stop.set()
    g._watchdog.join(5)


def test_nccl_already_non_blocking_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    lib = CupyLikeNccl()
    lib.blocking = False  # NCCL read 0 before us (another library's communicator)
    with pytest.raises(
        CommError,
        match=r"communicator init of group 'world'.*ncclInProgress "
        r"\(7\).*unset NCCL_COMM_BLOCKING",
    ) as e:
        nb.NcclProcessGroup.create(DictStore(), 0, 1, [0], 5, "world", 0, runtime=_cupy_runtime(lib))
    assert isinstance(e.value.__cause__, KeyError)


def test_poisoned_group_aborts_and_names_the_first_failure():
    """A collective that failed on this rank alone (issue 30 item 7): poison() aborts the
    communicator and every later collective raises naming the failure (the base class's abort()
    alone would say "group 'world' was shut down" and name none)."""
    g, comm, rt = make_group(size=2)
    why = "rank 0: all_reduce on group 'world' was refused on this rank (ConfigError: unknown op)"
    g.poison(why)
    assert g.failed and comm.aborted
    with pytest.raises(CommError, match="refused on this rank"):
        g.all_reduce(np.ones(3, np.float32))
    g.shutdown()


def test_peer_learns_the_poison_through_the_store_once_its_op_is_overdue(monkeypatch):
    """Rank 0 poisons the group; rank 1's all_reduce with it never completes (the fake's events
    stay pending). Its watchdog looks at the store only once the op has run POISON_PROBE_AFTER
    (0.05 s here) and fails the group naming rank 0's reason, long before the 30 s timeout.
    Before: rank 1 waited for its timeout."""
    monkeypatch.setattr(nw, "POISON_PROBE_AFTER", 0.05)
    store = DictStore()
    rt0, rt1 = FakeRuntime(), FakeRuntime(complete=False)
    groups = [
        nb.NcclProcessGroup(
            rt.new_comm(2, b"x" * 128, r),
            rt,
            rank=r,
            size=2,
            ranks=range(2),
            timeout=30.0,
            name="world",
            store=store,
            poll=0.01,
        )
        for r, rt in ((0, rt0), (1, rt1))
    ]
    try:
        groups[1].all_reduce(np.ones(3, np.float32))  # pending for ever
        why = "rank 0: a step of DistributedGradReducer failed on this rank (RuntimeError: boom)"
        groups[0].poison(why)
        wait_for(lambda: groups[1].failed, limit=10)
        with pytest.raises(CommError, match=r"a peer gave up on group 'world': rank 0: a step .*boom"):
            groups[1].all_reduce(np.ones(3, np.float32))
        assert rt1.comms[0].aborted
    finally:
        for g in groups:
            g.shutdown()
