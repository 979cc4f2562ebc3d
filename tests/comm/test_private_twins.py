"""Private arrays on the shm transport take the in-place paths through a shared twin (their pages
adopted into shared memory, or a mirror): the bits of the staged path, reuse after the array is
written again, a freed array's twin never serving the next one at its address, and nothing of the
twins left after the group closes or a rank is killed."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
from host_collectives import close_group, host_group, rank_data
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host import adopt, twins
from nccl_ddp.errors import CommError

# one chunk of the default 2 MiB each: the staged path splits the parts as the in-place one
# does, so even 3 ranks add in the same order (x_r first, then the others in rank order)
SIZES = (70_001, 250_007)
CASES = [
    (np.dtype(np.float32), ReduceOp.SUM),
    (np.dtype(np.float16), ReduceOp.SUM),
    (np.dtype(np.float64), ReduceOp.AVG),
    (np.dtype(np.int32), ReduceOp.MAX),
]


def _segments_mapped() -> int:
    """Mappings of our segments (unnamed /dev/shm files) in this process, but the freed heap
    buffers' pages that stay shared (adopt.py: the heap reuses them)."""
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/#" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                n += not any(a <= lo and hi <= b for a, b in adopt._STALE)
    return n


def _twins_off(t, off):
    os.environ["NCCL_DDP_HOST_ADOPT"] = "0" if off else "1"
    t.twins.max_bytes = 0 if off else twins.MIRROR_BYTES


def _staged(g, fn):
    """`fn()` with no twins on this rank: the staged path on every rank."""
    _twins_off(g._transport, True)
    try:
        return fn()
    finally:
        _twins_off(g._transport, False)


def _private(n, dt, kind):
    """A private array: NumPy's own (adopted where glibc mapped it alone) or over foreign memory
    (a bytearray: always mirrored)."""
    if kind == "numpy":
        return np.empty(n, dt)
    return np.frombuffer(bytearray(n * dt.itemsize), dt)


def bits_body(rank, world):
    baseline = _segments_mapped()
    g, store = host_group(rank, world)
    t = g._transport
    paths, checked = set(), 0
    for n in SIZES:
        for dt, op in CASES:
            for kind in ("numpy", "foreign"):
                x = _private(n, dt, kind)
                for round_ in range(3):  # staged (seen first), twin made, the same array written again
                    data = rank_data(rank, dt, n, op) + dt.type(round_)
                    want = data.copy()
                    _staged(g, lambda w=want: g.all_reduce(w, op).wait())
                    x[...] = data
                    g.all_reduce(x, op).wait()
                    paths.add((round_, t.twins.last))
                    np.testing.assert_array_equal(x, want, err_msg=f"all_reduce {dt} {op} n={n} {kind}")
                    checked += 1
                # broadcast from the last rank, all_gather and reduce_scatter on the same kind
                want = data.copy()
                _staged(g, lambda w=want: g.broadcast(w, world - 1).wait())
                x[...] = data
                g.broadcast(x, world - 1).wait()
                np.testing.assert_array_equal(x, want, err_msg=f"broadcast {dt} n={n} {kind}")
                x[...] = data
                m = n - n % world
                out, ref = np.empty(m // world, dt), np.empty(m // world, dt)
                _staged(g, lambda: g.reduce_scatter(ref, data[:m].copy(), op).wait())
                g.reduce_scatter(out, x[:m], op).wait()
                np.testing.assert_array_equal(out, ref, err_msg=f"reduce_scatter {dt} {op} n={n} {kind}")
                full, ref = _private(m * world, dt, kind), np.empty(m * world, dt)
                _staged(g, lambda: g.all_gather(ref, data[:m].copy()).wait())
                g.all_gather(full, x[:m]).wait()
                np.testing.assert_array_equal(full, ref, err_msg=f"all_gather {dt} n={n} {kind}")
                checked += 3
    close_group(g, store)
    gc.collect()
    return checked, sorted(paths), adopt.count(), _segments_mapped() - baseline


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_private_arrays_in_place_give_the_bits_of_the_staged_path(world):
    res = run_ranks(bits_body, world, timeout=240)
    n = len(SIZES) * len(CASES) * 2 * 6
    for checked, paths, left, mapped in res:
        assert checked == n
        assert {p for r, p in paths if r == 0} == {"staged"}, paths
        assert {p for r, p in paths if r > 0} == {"adopted", "mirror"}, paths
        assert left == 0, "adopted arrays stayed adopted after the group closed"
        assert mapped == 0, "shared segments still mapped after the group closed"


def reuse_body(rank, world):
    g, store = host_group(rank, world)
    t = g._transport
    n = 1 << 20  # 4 MiB of float32: glibc maps it alone, so it is adopted
    addresses, adopted_again, mirrored_again = set(), 0, 0
    for i in range(4):  # each array freed before the next; the kernel tends to hand its range back
        x = np.full(n, rank + i, np.float32)
        addresses.add(x.ctypes.data)
        assert t.twins.get(x) is None and t.twins.get(x).path == "adopted"  # (new: seen once)
        g.all_reduce(x).wait()
        np.testing.assert_array_equal(x, np.full(n, sum(r + i for r in range(world)), np.float32))
        adopted_again += adopt.count() == 1
        del x
        gc.collect()
        assert adopt.count() == 0, "a dead array stayed adopted"
    for i in range(4):  # foreign memory: mirrors keyed by address, written before every use
        raw = bytearray(n * 4)
        y = np.frombuffer(raw, np.float32)
        y[...] = rank * 7 + i
        t.twins.get(y)
        g.all_reduce(y).wait()
        np.testing.assert_array_equal(y, np.full(n, sum(r * 7 + i for r in range(world)), np.float32))
        mirrored_again += t.twins.mirrors()
        del y, raw
        gc.collect()
    assert t.twins.mirrors() == 0, "a dead buffer's mirror was kept"
    # an adopted array resized: NumPy 2 refuses (its weakref); where it is not refused, realloc
    # moved or resized it, and it is adopted anew, still right
    z = np.full(n, rank + 1.0, np.float32)
    g.all_reduce(z).wait()
    try:
        z.resize(2 * n, refcheck=False)
    except ValueError:
        z = np.empty(2 * n, np.float32)
    z[...] = rank + 2.0
    g.all_reduce(z).wait()
    np.testing.assert_array_equal(z, np.full(2 * n, sum(r + 2.0 for r in range(world)), np.float32))
    close_group(g, store)
    assert z.sum() == 2 * n * sum(r + 2.0 for r in range(world))  # back in private memory, intact
    z[...] = 0  # and writable
    return len(addresses), adopted_again, mirrored_again


@pytest.mark.slow
def test_a_freed_array_and_one_allocated_at_its_address_are_twinned_anew():
    for n_addr, adopted_again, mirrored in run_ranks(reuse_body, 2, timeout=120):
        assert adopted_again == 4 and mirrored == 4
        assert n_addr >= 1


def killed_body(rank, world):
    g, store = host_group(rank, world, timeout=20)
    x = np.full(1 << 20, 1.0, np.float32)
    y = np.frombuffer(bytearray(1 << 20), np.float32)
    for _ in range(2):  # the first staged, then twins
        g.all_reduce(x).wait()
        g.all_reduce(y).wait()
    assert adopt.count() == 1 and g._transport.twins.mirrors() == 1
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(CommError, match="peer rank 1"):
        g.all_reduce(x).wait()
    g.shutdown()
    store.close()
    assert adopt.count() == 0 and set(np.unique(x)) <= {4.0, 8.0}  # (readable: private again)
    return "ok"


@pytest.mark.slow
def test_a_rank_killed_with_twins_leaves_nothing():
    failed = run_ranks(killed_body, 2, timeout=90, expect_fail=True)
    assert set(failed) == {1} and "SIGKILL" in failed[1], failed
    # (no_shm_leaks checks /dev/shm; the segments have no name, so the kernel freed them with
    # their last mapping: the survivor's, which shutdown unmapped)


def test_a_forked_child_gets_private_copies_of_adopted_arrays():
    adopt.hold()
    try:
        x = np.full(1 << 20, 1.0, np.float32)
        a = adopt.adopted(x)
        assert a is not None and x.ctypes.data <= a.lo < a.hi <= x.ctypes.data + x.nbytes
        pid = os.fork()
        if pid == 0:  # the child writes its copy; the parent's must not change
            x[...] = 5.0
            os._exit(0 if adopt.count() == 0 and x.sum() == 5.0 * x.size else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child failed or hung"
        assert (x == 1.0).all(), "the child's writes reached the parent's adopted array"
    finally:
        adopt.let_go()
    assert adopt.count() == 0 and (x == 1.0).all()
