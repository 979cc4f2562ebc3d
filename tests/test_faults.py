"""Faults found by attacking the runtime (issue 13), each kept fixed by a test that failed before.

Multi-process cases run on loopback with a hard bound (tests/mp.py); the slow variants are
marked `slow`.
"""
import numpy as np
import pytest

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError
from mp import run_ranks

f32 = np.float32


def _outcome(fn):
    """('ok', value) or (exception class name, message): what a rank saw."""
    try:
        return "ok", fn()
    except Exception as e:  # the test asserts on it
        return type(e).__name__, str(e)


# -- silent wrong results ------------------------------------------------------------------------


def _disagree_on_members(rank, world, transport):
    import os
    os.environ["NCCL_DDP_HOST_TRANSPORT"] = transport
    nd.init_process_group("host", timeout=10)
    try:
        members = [0, 1] if rank == 0 else [1, 2]
        g = _outcome(lambda: nd.new_group(members))
        if g[0] != "ok":
            return g
        x = np.full(2, 10.0 ** rank, f32)         # 1, 10, 100
        return _outcome(lambda: nd.all_reduce(x, group=g[1]).tolist())
    finally:
        nd.destroy_process_group()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_new_group_with_different_members_raises_instead_of_wrong_sums(transport):
    # before: rank 0's all_reduce returned 101.0 (it met rank 1 as "group rank 0"'s peer)
    r0, r1, r2 = run_ranks(_disagree_on_members, 3, transport, timeout=60)
    assert r0[0] == "RankMismatchError", r0
    assert "[0, 1]" in r0[1] and "[1, 2]" in r0[1] and r0[1].startswith("rank 0:"), r0
    assert r1 == r2 == ("ok", [110.0, 110.0]), (r1, r2)   # their group is consistent


def _broadcast_src_mismatch(rank, world, transport):
    import os
    os.environ["NCCL_DDP_HOST_TRANSPORT"] = transport
    nd.init_process_group("host", timeout=10)
    try:
        x = np.full(3, float(rank), f32)
        return _outcome(lambda: nd.broadcast(x, src=0 if rank == 0 else 1).tolist())
    finally:
        nd.destroy_process_group()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_broadcast_src_mismatch_fails_at_once_on_every_rank(transport):
    # before (tcp): every rank returned without error; the next collective failed under its name
    for rank, (kind, msg) in enumerate(run_ranks(_broadcast_src_mismatch, 3, transport,
                                                 timeout=60)):
        assert kind in ("RankMismatchError", "CommError"), (rank, kind, msg)
        assert "broadcast" in msg, (rank, msg)
        assert "RankMismatch" in msg or kind == "RankMismatchError" or "gave up" in msg, msg


def _params_in_another_order(rank, world):
    from nccl_ddp.adapters.arrays import ArrayModule
    nd.init_process_group("host", timeout=10)
    try:
        a, b = np.full(2, 1.0 + rank, f32), np.full(2, 100.0 + rank, f32)
        params = {"a": a, "b": b} if rank == 0 else {"b": b, "a": a}
        return _outcome(lambda: nd.DistributedDataParallel(ArrayModule(params)).close())
    finally:
        nd.destroy_process_group()


def test_ddp_same_shapes_in_another_order_names_both_parameters():
    # before: init_sync passed and rank 0's 'a' was averaged with rank 1's 'b'
    for rank, (kind, msg) in enumerate(run_ranks(_params_in_another_order, 2, timeout=60)):
        assert kind == "RankMismatchError", (rank, kind, msg)
        assert "parameter 0: rank 0 has 'a' of shape (2,) float32, rank 1 has 'b' of shape " \
               "(2,) float32" in msg, msg


# -- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e10, float("inf"), 0, -1.0])
def test_init_process_group_timeout_out_of_range_is_a_config_error(timeout):
    # before: 1e10 passed the check and overflowed later (OverflowError: timeout value is too large)
    with pytest.raises(ConfigError, match="init_process_group: timeout"):
        nd.init_process_group("host", timeout=timeout, rank=0, world_size=1)
    assert not nd.is_initialized()
