"""`all_gather_parts` on the host backend (ZeRO-3's gather without a gathered buffer): every
rank's input handed to the caller's function, in place (the peers' own shared memory, no chunk
staged) where all are shared, else from a staged gather, on the shm and the TCP transports with
the bits of `all_gather`; a rank killed while its peers read its shard fails them instead of
hanging them, and /dev/shm is left clean."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from host_collectives import close_group, host_group, rank_data
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.device import HostDevice

N = 40_003  # over the 64 KiB one-signal size in float32, several 4 KiB chunks
F32 = np.dtype(np.float32)


def parts_body(rank, world, transport):
    """shared inputs (g.zeros) are read in place; private and small ones through a gather; the
    parts equal every rank's input, as all_gather gives them."""
    g, store = host_group(rank, world, transport=transport, chunk_bytes=4096)
    dev = HostDevice()
    assert g.gathers_in_parts(dev)
    ins = [rank_data(r, F32, N, ReduceOp.SUM) for r in range(world)]
    seen = {}
    for kind in ("shared", "private", "small"):
        n = 100 if kind == "small" else N
        inp = g.zeros(dev, n, F32) if kind == "shared" else np.empty(n, F32)
        inp[...] = ins[rank][:n]
        got: list = []

        def apply(parts):
            got.append([np.array(p) for p in parts])
            got.append(np.shares_memory(parts[rank], inp))  # (own input itself, not a staged copy)

        staged = getattr(g._transport, "chunks", 0)
        g.all_gather_parts(inp, apply, tag=f"{kind} parts").wait()
        copies, own = got
        for j in range(world):
            np.testing.assert_array_equal(copies[j], ins[j][:n], err_msg=f"{kind} part {j}")
        ref = np.empty(world * n, F32)
        g.all_gather(ref, inp).wait()
        np.testing.assert_array_equal(np.concatenate(copies), ref, err_msg=kind)
        in_place = own and getattr(g._transport, "chunks", 0) == staged
        seen[kind] = in_place
    close_group(g, store)
    return seen


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_parts_are_every_ranks_input_read_in_place_when_shared(world):
    assert (
        run_ranks(parts_body, world, "auto", timeout=120)
        == [{"shared": True, "private": False, "small": False}] * world
    )


@pytest.mark.slow
def test_parts_on_the_tcp_transport_come_from_a_gather():
    assert (
        run_ranks(parts_body, 2, "tcp", timeout=120)
        == [{"shared": False, "private": False, "small": False}] * 2
    )


def killed_mid_gather(rank, world):
    """Rank 1 is killed inside its copy, the peers waiting on its last signal: they fail."""
    g, store = host_group(rank, world, timeout=30.0)
    inp = g.zeros(HostDevice(), N, F32)
    inp[...] = rank

    def apply(parts):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    g.all_gather_parts(inp, apply, tag="a unit's shard").wait()
    close_group(g, store)


@pytest.mark.slow
def test_a_rank_killed_mid_gather_fails_its_peers_at_once():
    failed = run_ranks(killed_mid_gather, 3, timeout=60, expect_fail=True)
    assert sorted(failed) == [0, 1, 2], failed  # (within the grace: none left hanging)
    assert "SIGKILL" in failed[1], failed[1]
    for r in (0, 2):
        assert "CommError" in failed[r] and "rank 1" in failed[r], failed[r]
