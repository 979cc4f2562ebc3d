"""Buffers in the group's shared memory (`ProcessGroup.zeros`, DDP's buckets on the host's shm
transport): an all-reduce whose buffers all live there reads the peers' in place, with the results
of the staged path; a rank with a private buffer sends every rank down the staged path; a freed
buffer's memory is never read as a new one's."""

from __future__ import annotations

import gc
import hashlib
import os

import numpy as np
import pytest
from host_collectives import check_result, close_group, expected_result, host_group, rank_data
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host import shared, twins
from nccl_ddp.comm.host.shm import SMALL_BYTES
from nccl_ddp.device import HostDevice
from nccl_ddp.errors import CommError

CASES = [
    (np.dtype(np.float32), ReduceOp.SUM),
    (np.dtype(np.float32), ReduceOp.AVG),
    (np.dtype(np.float16), ReduceOp.SUM),
    (np.dtype(np.int32), ReduceOp.MAX),
    (np.dtype(np.float64), ReduceOp.PROD),
]
N = 70_001  # over the 64 KiB one-signal size for every dtype here, several 4 KiB chunks


def twins_off(t, off):
    """Private buffers get no shared twin on this rank (neither adopted nor mirrored): the staged
    path, or with `off` False, twins again."""
    os.environ["NCCL_DDP_HOST_ADOPT"] = "0" if off else "1"
    t.twins.max_bytes = 0 if off else twins.MIRROR_BYTES


def shared_body(rank, world):
    from nccl_ddp.comm.host import shm

    shm.PIECE_BYTES = 16 << 10  # N spans several pieces of the in-place all-reduce (256 KiB: one)
    g, store = host_group(rank, world, chunk_bytes=4096)
    dev = HostDevice()
    digest = hashlib.sha256()
    for dt, op in CASES:
        ins = [rank_data(r, dt, N, op) for r in range(world)]
        staged = ins[rank].copy()
        twins_off(g._transport, True)
        g.all_reduce(staged, op).wait()
        twins_off(g._transport, False)
        buf = g.zeros(dev, N + 3, dt)
        assert shared.where(buf) is not shared.NOT_SHARED, "g.zeros on shm gave private memory"
        view = buf[3:]  # an offset into the segment, as a bucket's slice
        view[...] = ins[rank]
        g.all_reduce(view, op).wait()
        check_result(view, expected_result(ins, op, world), f"shared all_reduce {dt} {op}")
        if world == 2 or dt.kind != "f":  # two operands: the same bits whoever adds them
            np.testing.assert_array_equal(view, staged, err_msg=f"{dt} {op}: in place != staged")
        assert not buf[:3].any(), "bytes before the view were written"
        digest.update(view.tobytes())
    mapped = len(g._transport._mapped)
    # mixed: only rank 0's buffer is shared, the others have no twin -> the staged path on
    # every rank, same result
    ins = [rank_data(r, np.dtype(np.float32), N, ReduceOp.SUM) for r in range(world)]
    buf = g.zeros(dev, N, np.float32) if rank == 0 else np.empty(N, np.float32)
    buf[...] = ins[rank]
    twins_off(g._transport, rank != 0)
    g.all_reduce(buf).wait()
    twins_off(g._transport, False)
    check_result(buf, expected_result(ins, ReduceOp.SUM, world), "mixed shared/private")
    digest.update(buf.tobytes())
    # a freed buffer's descriptor and inode may be reused by the next: never read as the old one
    for i in range(4):
        a = g.zeros(dev, N, np.float32)
        a[...] = rank + 10 * i
        g.all_reduce(a).wait()
        np.testing.assert_array_equal(a, np.full(N, sum(r + 10 * i for r in range(world)), np.float32))
        del a
        gc.collect()
    close_group(g, store)
    return mapped, digest.hexdigest()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_shared_buffers_are_reduced_in_place_like_the_staged_path(world):
    res = run_ranks(shared_body, world, timeout=120)
    assert all(mapped >= world - 1 for mapped, _ in res), res  # the peers' buffers were mapped
    assert len({d for _, d in res}) == 1  # every rank holds bitwise the same results


def tcp_body(rank, world):
    g, store = host_group(rank, world, transport="tcp")
    buf = g.zeros(HostDevice(), N, np.float32)
    private = shared.where(buf) is shared.NOT_SHARED
    close_group(g, store)
    return private


@pytest.mark.slow
def test_zeros_is_private_memory_off_the_shm_transport():
    assert run_ranks(tcp_body, 2, timeout=60) == [True, True]


def test_a_freed_shared_buffer_closes_its_descriptor():
    before = len(os.listdir("/proc/self/fd"))
    a = shared.shared_zeros(1 << 20, np.float32)
    assert a is not None and not a.any() and shared.where(a[5:9]) is not shared.NOT_SHARED
    key = shared._SHARED[a.ctypes.data][1]
    fd = int(key.split(":")[1])
    assert os.path.exists(f"/proc/self/fd/{fd}")  # kept open: peers map it through it
    del a
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    assert shared.where(np.ones(10)) is shared.NOT_SHARED


def test_no_room_in_dev_shm_gives_private_memory(monkeypatch, caplog):
    def full(nbytes, sharers=1):
        raise CommError("/dev/shm is too small (test)")

    monkeypatch.setattr(shared.Segment, "create", full)
    monkeypatch.setattr(shared, "_SAID_NO_ROOM", False)
    with caplog.at_level("DEBUG", logger="nccl_ddp.comm.host.shared"):
        assert shared.shared_zeros(1000, np.float32) is None
        assert shared.shared_zeros(1000, np.float32) is None
    said = [r for r in caplog.records if "no shared bucket memory" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "DEBUG"]  # warned once, not per bucket
    assert "too small" in said[0].getMessage()


def premul_body(rank, world, transport):
    from nccl_ddp.kernels.spec import scale_ref

    g, store = host_group(rank, world, transport=transport, chunk_bytes=4096)
    dev = HostDevice()
    checked = 0
    for dt in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)):
        for factor in (0.5, 1.0 / 3.0):
            for n in (1000, N):  # the one-signal size and the chunked / in-place one
                ins = [rank_data(r, dt, n, ReduceOp.SUM) * 1000 for r in range(world)]
                for in_place in (True, False):  # (with 3 ranks each path adds in its own order)
                    want, buf = (g.zeros(dev, n, dt) if in_place else np.empty(n, dt) for _ in "ab")
                    want[...] = buf[...] = ins[rank]
                    scale_ref(want, factor)
                    g.all_reduce(want).wait()  # the unfused way: scale, then sum
                    g.all_reduce_premul_sum(buf, factor).wait()
                    np.testing.assert_array_equal(buf, want, err_msg=f"{dt} {factor} n={n} shared={in_place}")
                    checked += 1
    # ranks that scale by different factors: each rank's own factor applies to its own buffer
    ins = [rank_data(r, np.dtype(np.float32), N, ReduceOp.SUM) for r in range(world)]
    buf = g.zeros(dev, N, np.float32)
    buf[...] = ins[rank]
    g.all_reduce_premul_sum(buf, 1.0 / (rank + 1)).wait()
    check_result(buf, sum(x / (r + 1) for r, x in enumerate(ins)).astype(np.float32), "factors that differ")
    g.barrier().wait()
    with pytest.raises(Exception, match="a pre-multiplied reduction is a SUM of floats"):
        g.all_reduce_premul_sum(np.ones(10, np.int32), 0.5).wait()  # (refused: the group is done)
    g.shutdown()
    store.barrier("closing", g.size, 30)
    store.close()
    return checked


@pytest.mark.parametrize("world,transport", [(1, "auto"), (2, "shm"), (3, "shm"), (2, "tcp")])
@pytest.mark.slow
def test_premul_sum_has_the_bits_of_scaling_first(world, transport):
    assert run_ranks(premul_body, world, transport, timeout=120) == [24] * world


KINDS = ("staged", "private", "shared", "mixed")


def gather_scatter_body(rank, world):
    """reduce_scatter and all_gather with every rank's input shared (read in place: no chunk
    staged), private (its twin read in place), staged, and shared on rank 0 only; all give the
    same bits, the right ones."""
    g, store = host_group(rank, world, chunk_bytes=4096)
    dev, t = HostDevice(), g._transport
    n = N // world * world

    def inputs(kind, size, dt):
        """shared: from g.zeros; private: np.empty (a twin: adopted or mirrored, in place);
        staged: np.empty without twins; mixed: shared on rank 0, staged elsewhere."""
        shared_here = kind == "shared" or (kind == "mixed" and rank == 0)
        twins_off(t, kind in ("staged", "mixed") and not shared_here)
        return g.zeros(dev, size, dt) if shared_here else np.empty(size, dt)

    checked = 0
    for dt, op in CASES[:4]:
        ins = [rank_data(r, dt, n, op) for r in range(world)]
        want_rs = expected_result(ins, op, world).reshape(world, -1)[rank]
        results = {}
        for kind in KINDS:
            inp = inputs(kind, n, dt)
            inp[...] = ins[rank]
            out = np.empty(n // world, dt)
            t.twins.get(inp)  # (seen once: a private buffer's first op is staged, its twin made next)
            staged = t.chunks
            g.reduce_scatter(out, inp, op).wait()
            moved = t.chunks - staged
            assert (moved == 0) == (kind in ("shared", "private")), f"reduce_scatter {kind}: {moved} staged"
            check_result(out, want_rs, f"reduce_scatter {kind} {dt} {op}")
            results[kind] = out
        if world == 2 or dt.kind != "f":
            for kind in KINDS[1:]:
                np.testing.assert_array_equal(results[kind], results["staged"], err_msg=f"{dt} {op} {kind}")
        for kind in KINDS:
            full = inputs(kind, n, dt)  # ZeRO's form: the input is this rank's slice of the output
            part = full[rank * (n // world) : (rank + 1) * (n // world)]
            part[...] = ins[rank][: n // world]
            t.twins.get(part)
            staged = t.chunks
            g.all_gather(full, part).wait()
            moved = t.chunks - staged
            twinned = kind == "private" and part.nbytes > SMALL_BYTES  # (small ones are staged)
            assert (moved == 0) == (kind == "shared" or twinned), f"all_gather {kind}: {moved} staged"
            want = np.concatenate([ins[r][: n // world] for r in range(world)])
            np.testing.assert_array_equal(full, want, err_msg=f"all_gather {kind} {dt}")
            checked += 1
    close_group(g, store)
    return checked


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_reduce_scatter_and_all_gather_read_shared_inputs_in_place(world):
    assert run_ranks(gather_scatter_body, world, timeout=120) == [16] * world


def small_view_body(rank, world):
    g, store = host_group(rank, world, chunk_bytes=4096)
    buf = g.zeros(HostDevice(), N, np.float32)
    view = buf[8 : 8 + 8192]  # 32 KiB: over a chunk, under the one-signal size, in shared memory
    assert 4096 < view.nbytes <= SMALL_BYTES and shared.where(view) is not shared.NOT_SHARED
    view[...] = rank + 1
    g.all_reduce(view).wait()
    close_group(g, store)
    return float(view.min()), float(view.max()), bool(buf[:8].any())


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_shared_view_over_a_chunk_is_reduced_in_place(world):
    """A slice of a shared buffer between a chunk and the one-signal size has no twin of its own
    but lies in shared memory: every rank's first signal says so, and it is reduced in place."""
    total = float(sum(range(1, world + 1)))
    assert run_ranks(small_view_body, world, timeout=60) == [(total, total, False)] * world
