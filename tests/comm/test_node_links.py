"""Which ranks share a node is the launcher's word (GROUP_RANK), not the hostname's: two "nodes" on
one machine share no shared-memory segment and talk over TCP; the links between nodes count what
they send and, where asked (NCCL_DDP_HOST_THROTTLE_BPS), pace it with a token bucket."""

from __future__ import annotations

import os

import numpy as np
import pytest
from host_collectives import close_group, host_group
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host import throttle
from nccl_ddp.job.env import node_rank

N = 1 << 18  # float32: 1 MiB


def nodes_body(rank, world, per_node, hierarchy="0"):
    os.environ["GROUP_RANK"] = str(rank // per_node)
    os.environ["NCCL_DDP_HOST_HIERARCHY"] = hierarchy
    g, store = host_group(rank, world)
    kind = g.transport_kind
    before = g.cross_node_bytes()
    x = np.full(N, rank + 1.0, np.float32)
    g.all_reduce(x).wait()
    assert (x == sum(range(1, world + 1))).all()
    sent = g.cross_node_bytes() - before
    close_group(g, store)
    return kind, sent


@pytest.mark.slow
def test_two_nodes_on_one_machine_use_tcp_between_them_and_count_its_bytes():
    res = run_ranks(nodes_body, 4, 2, timeout=120)
    assert [k for k, _ in res] == ["tcp"] * 4, res
    # the flat ring 0 -> 1 -> 2 -> 3 -> 0 crosses between nodes on 1 -> 2 and 3 -> 0 only; each
    # rank sends 2(n-1)/n of the buffer, in 2 MiB pieces with a header each
    ring = 2 * 3 * N * 4 // 4
    assert [s for _, s in res][0::2] == [0, 0], res
    for _, sent in res[1::2]:
        assert ring <= sent <= ring + 64 * 32, res


@pytest.mark.slow
def test_ranks_of_one_node_keep_shared_memory():
    assert [k for k, s in run_ranks(nodes_body, 2, 2, timeout=60)] == ["shm", "shm"]


def test_node_rank_is_the_launchers():
    assert node_rank({"GROUP_RANK": "1", "NODE_RANK": "0"}) == 1
    assert node_rank({"NODE_RANK": "2"}) == 2
    assert node_rank({"SLURM_NODEID": "3"}) == 3
    assert node_rank({}) is None


def test_token_bucket_paces_to_its_rate(monkeypatch):
    clock, slept = [100.0], []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(throttle.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(throttle.time, "sleep", sleep)
    bucket = throttle.TokenBucket(1e6)  # 1 MB/s: a burst of 10 KB
    for _ in range(100):
        bucket.take(10_000)  # 1 MB in all
    assert sum(slept) == pytest.approx(0.99, rel=1e-6)  # the burst passed at once, the rest paced
    monkeypatch.setenv("NCCL_DDP_HOST_THROTTLE_BPS", "0")
    assert throttle.from_env() is None
    monkeypatch.setenv("NCCL_DDP_HOST_THROTTLE_BPS", "5000000")
    assert throttle.from_env().rate == 5e6


CASES = [
    (np.float32, ReduceOp.SUM, "random"),
    (np.float32, ReduceOp.SUM, "exact"),
    (np.float32, ReduceOp.AVG, "exact"),
    (np.int32, ReduceOp.SUM, "random"),
    (np.int64, ReduceOp.MAX, "random"),
    (np.float16, ReduceOp.SUM, "exact"),
    (np.float64, ReduceOp.PROD, "exact"),
]
SIZES = (0, 1, 3, 1001, 70_001, 600_003)


def _data(rank, dt, n, kind):
    rng = np.random.default_rng([rank, n])
    if kind == "exact":  # small integers: every partial sum exact, in any order
        return rng.integers(-8, 9, n).astype(dt) if dt != np.float64 else rng.choice([0.5, 1.0, 2.0], n)
    if np.dtype(dt).kind == "f":
        return rng.standard_normal(n).astype(dt)
    return rng.integers(-1000, 1000, n).astype(dt)


def hier_body(rank, world, per_node):
    """Every case on the hierarchy and on the flat ring (two groups of the same ranks): the
    bytes each sends to the other node, and a digest of the results."""
    import hashlib

    os.environ["GROUP_RANK"] = str(rank // per_node)
    out, store = {}, None
    for hierarchy in ("1", "0"):
        os.environ["NCCL_DDP_HOST_HIERARCHY"] = hierarchy
        g, store = host_group(rank, world, store=store, prefix=f"h{hierarchy}")
        digest, exact = hashlib.sha256(), []
        for dt, op, kind in CASES:
            for n in SIZES:
                x = _data(rank, dt, n, kind)
                g.all_reduce(x, op).wait()
                digest.update(x.tobytes())
                if kind == "exact" or np.dtype(dt).kind != "f":
                    exact.append(x.tobytes())
        g.broadcast(x, 1).wait()  # the other ops: the flat ring's
        big = np.ones(1 << 22, np.float32)  # 16 MiB: the bytes between nodes
        before = g.cross_node_bytes()
        g.all_reduce(big).wait()
        assert (big == world).all()
        out[hierarchy] = (g.transport_kind, digest.hexdigest(), exact, g.cross_node_bytes() - before)
        g.barrier().wait()
        g.shutdown()
    store.barrier("closing", world, 30)
    store.close()
    return out


@pytest.mark.slow
def test_hierarchical_all_reduce_crosses_between_nodes_once():
    res = run_ranks(hier_body, 4, 2, timeout=240)
    assert [r["1"][0] for r in res] == ["hier"] * 4 and [r["0"][0] for r in res] == ["tcp"] * 4
    assert len({r["1"][1] for r in res}) == 1  # every rank: the same bits
    for r in res:
        assert r["1"][2] == r["0"][2]  # exact sums, integers, max: the flat ring's bits
    hier_bytes, flat_bytes = (sum(r[h][3] for r in res) for h in ("1", "0"))
    # 2 nodes: the flat ring moves 3x the buffer between them, the hierarchy 2x (the least an
    # all-reduce between two nodes can: each must receive the other's share of every element)
    assert hier_bytes <= 0.7 * flat_bytes, (hier_bytes, flat_bytes)
