"""The host backend between real processes: every collective and dtype against NumPy, on the
shared-memory and the TCP transport, with 2 and 3 ranks; ordering, subgroups and failures."""

from __future__ import annotations

import hashlib
import os
import re
import time

import numpy as np
import pytest
from host_collectives import (
    DTYPES,
    OPS,
    SIZES,
    check_result,
    close_group,
    expected_result,
    host_group,
    rank_data,
)
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.errors import CommError, CommTimeout, ConfigError, ConfigTypeError


def _ops_for(dt):
    return (ReduceOp.MAX, ReduceOp.MIN) if dt == np.bool_ else OPS


def collectives_body(rank, world, transport):
    g, store = host_group(rank, world, transport, chunk_bytes=4096)
    digest = hashlib.sha256()
    for dt in DTYPES:
        for n in SIZES:
            for op in _ops_for(dt):
                ins = [rank_data(r, dt, n, op) for r in range(world)]
                buf = ins[rank].copy()
                g.all_reduce(buf, op).wait()
                check_result(buf, expected_result(ins, op, world), f"all_reduce {dt} n={n} {op}")
                digest.update(buf.tobytes())
            ins = [rank_data(r, dt, n, ReduceOp.MAX) for r in range(world)]
            buf = ins[rank].copy()
            g.broadcast(buf, root=world - 1).wait()
            np.testing.assert_array_equal(buf, ins[world - 1], err_msg=f"broadcast {dt} {n}")
            out = np.empty(world * n, dt)
            g.all_gather(out, ins[rank]).wait()
            np.testing.assert_array_equal(out, np.concatenate(ins), err_msg=f"all_gather {dt}")
            for op in _ops_for(dt)[:3]:
                big = [rank_data(r, dt, world * n, op) for r in range(world)]
                out = np.empty(n, dt)
                g.reduce_scatter(out, big[rank], op).wait()
                want = expected_result(big, op, world)[rank * n : (rank + 1) * n]
                check_result(out, want, f"reduce_scatter {dt} n={n} {op}")
    # bigger than one default chunk: the pipelined path with real chunk sizes
    g.shutdown()
    g, store = host_group(rank, world, transport, store=store, prefix="default-chunks")
    ins = [rank_data(r, np.dtype(np.float32), 300_001, ReduceOp.SUM) for r in range(world)]
    buf = ins[rank].copy()
    g.all_reduce(buf).wait()
    np.testing.assert_allclose(buf, np.sum(ins, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    digest.update(buf.tobytes())
    kind = g.transport_kind
    close_group(g, store)
    return kind, digest.hexdigest()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.slow
def test_collectives_match_numpy(world, transport):
    res = run_ranks(collectives_body, world, transport, timeout=150)
    assert {k for k, _ in res} == {transport}
    assert len({d for _, d in res}) == 1  # every rank holds bitwise the same all_reduce results


def ordering_body(rank, world):
    from nccl_ddp.device import HostStream

    g, store = host_group(rank, world)
    # several async ops, waited for in reverse order
    bufs = [np.full(100_000, float(rank + i), np.float64) for i in range(5)]
    works = [g.all_reduce(b) for b in bufs]
    for i, w in reversed(list(enumerate(works))):
        w.wait()
        assert works[i].is_completed()
        assert works[i].result() is bufs[i]
        np.testing.assert_array_equal(bufs[i], sum(r + i for r in range(world)))
    # a stream: the collective runs after the stream's earlier work, its later work after it
    stream = HostStream("test")
    buf = np.zeros(10_000, np.float32)
    seen = {}

    def slow_fill():
        time.sleep(0.3)
        buf[:] = rank + 1

    stream.submit(slow_fill)
    w = g.all_reduce(buf, stream=stream)
    stream.submit(lambda: seen.setdefault("after", buf.copy()))
    stream.synchronize(30)
    total = sum(r + 1 for r in range(world))
    np.testing.assert_array_equal(seen["after"], total)
    assert w.is_completed()
    # the caller's immediate stream (synchronous API): runs after what is queued, done on return
    from nccl_ddp.device import HostDevice

    stream.submit(time.sleep, 0.3)
    first = g.all_reduce(np.ones(3), stream=stream)
    now = np.full(4, rank + 1)
    w = g.all_reduce(now, stream=HostDevice().current_stream())
    assert first.is_completed() and w.is_completed()
    np.testing.assert_array_equal(now, total)
    w = g.all_reduce(now, stream=HostDevice().current_stream())  # idle group: runs inline
    assert w.is_completed()
    np.testing.assert_array_equal(now, total * world)
    stream.close()
    close_group(g, store)


@pytest.mark.slow
def test_async_and_stream_ordering():
    run_ranks(ordering_body, 2, timeout=60)


def subgroup_body(rank, world):
    g, store = host_group(rank, world)
    sub = g.new_subgroup([2, 0])
    if rank == 1:
        assert sub is None
    else:
        assert sub.ranks == (0, 2) and sub.rank == rank // 2 and sub.size == 2
        x = np.full(5, rank + 1, np.int32)
        sub.all_reduce(x).wait()
        np.testing.assert_array_equal(x, 1 + 3)
        sub.shutdown()
    x = np.full(5, rank, np.int64)
    g.all_reduce(x, ReduceOp.MAX).wait()  # the world group still works
    np.testing.assert_array_equal(x, world - 1)
    with pytest.raises(ConfigError, match="not members"):
        g.new_subgroup([0, 7])
    close_group(g, store)


@pytest.mark.slow
def test_subgroup():
    run_ranks(subgroup_body, 3, timeout=60)


def mismatch_body(rank, world):
    g, store = host_group(rank, world, timeout=20)
    try:
        g.all_reduce(np.zeros(10 + rank, np.float32)).wait()
    except CommError as e:  # RankMismatchError is not a CommError: this is a failure
        raise AssertionError(f"expected a RankMismatchError, got {e!r}") from e
    finally:
        g.shutdown()
        store.close()


@pytest.mark.slow
def test_mismatched_sizes_name_the_peer():
    failed = run_ranks(mismatch_body, 2, timeout=60, expect_fail=True)
    assert set(failed) == {0, 1}
    for r, tb in failed.items():
        assert "RankMismatchError" in tb and f"peer rank {1 - r}" in tb, tb


def dying_body(rank, world, transport):
    g, store = host_group(rank, world, transport, timeout=60)
    x = np.ones(1 << 20, np.float32)
    g.all_reduce(x).wait()
    if rank == 1:
        time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        g.all_reduce(x).wait()
    except CommError as e:
        raise RuntimeError(
            f"rank {rank} got {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
        ) from e
    return "no error"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.slow
def test_dead_rank_is_named(transport):
    failed = run_ranks(dying_body, 3, transport, timeout=60, expect_fail=True)
    assert set(failed) == {0, 1, 2}
    assert "exited with code 3" in failed[1]
    for r in (0, 2):
        assert "CommError" in failed[r] and "peer rank 1" in failed[r], failed[r]
        secs = float(re.search(r"got CommError after ([\d.]+)s", failed[r]).group(1))
        assert secs < 30, failed[r]  # well within the 60 s group timeout


def hung_body(rank, world):
    g, store = host_group(rank, world, timeout=2.0)
    if rank == 1:
        time.sleep(4)  # never joins the collective, but stays alive
        return "slept"
    t0 = time.monotonic()
    try:
        g.all_reduce(np.ones(10)).wait(30)
    except CommTimeout as e:
        raise RuntimeError(f"got CommTimeout after {time.monotonic() - t0:.1f}s: {e}") from e


@pytest.mark.slow
def test_unresponsive_peer_times_out_naming_it():
    failed = run_ranks(hung_body, 2, timeout=60, expect_fail=True)
    assert set(failed) == {0}
    assert "peer rank 1 sent nothing for 2.0s" in failed[0] and "all_reduce #1" in failed[0]
    secs = float(re.search(r"got CommTimeout after ([\d.]+)s", failed[0]).group(1))
    assert 1.5 < secs < 10, failed[0]


def absent_body(rank, world):
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import connect_store

    if rank == 2:
        return "never joins"
    store = connect_store(resolve_env(), timeout=30)
    from nccl_ddp.store.client import PrefixStore

    try:
        HostProcessGroup(PrefixStore(store, "test"), rank, world, timeout=2.0)
    finally:
        time.sleep(0.5)  # rank 0 hosts the store: let rank 1 read it first
        store.close()


@pytest.mark.slow
def test_missing_rank_times_out_naming_it():
    failed = run_ranks(absent_body, 3, timeout=60, expect_fail=True)
    assert set(failed) == {0, 1}
    for tb in failed.values():
        assert "CommTimeout" in tb and "ranks [2] did not join" in tb, tb


def test_single_rank_group_and_argument_errors():
    g = HostProcessGroup(None, 0, 1)
    x = np.arange(6, dtype=np.int32)
    g.all_reduce(x, "avg").wait()
    np.testing.assert_array_equal(x, np.arange(6))
    out = np.empty(6, np.int32)
    g.all_gather(out, x).wait()
    np.testing.assert_array_equal(out, x)
    with pytest.raises(ConfigTypeError, match="complex64 is not supported"):
        g.all_reduce(np.zeros(3, np.complex64))
    with pytest.raises(ConfigError, match="not defined for bool"):
        g.all_reduce(np.zeros(3, bool), "sum")
    with pytest.raises(ConfigError, match="group size"):
        g.all_gather(np.empty(5, np.int32), x)
    with pytest.raises(ConfigError, match="C-contiguous"):
        g.all_reduce(np.zeros(10)[::2])
    with pytest.raises(ValueError, match="unknown reduce op"):
        g.all_reduce(x, "mean")
    g.shutdown()
    with pytest.raises(CommError, match="shut down"):
        g.barrier()


def test_work_wait_times_out():
    from nccl_ddp.device import HostStream

    g = HostProcessGroup(None, 0, 1)
    stream = HostStream("blocked")
    stream.submit(time.sleep, 1.0)
    w = g.barrier(stream=stream)
    with pytest.raises(CommTimeout, match="barrier #1"):
        w.wait(0.1)
    assert w.wait(10)
    stream.close()
    g.shutdown()
