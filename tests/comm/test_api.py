"""The functional API (nccl_ddp.init_process_group, all_reduce, ...) on the host backend:
NumPy and torch CPU arrays through DLPack, in place or new, sync and async, groups, errors."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, ConfigTypeError

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def single_process(monkeypatch):
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(k, raising=False)
    yield
    nd.destroy_process_group()


def test_calls_before_init_say_what_to_do():
    assert not nd.is_initialized()
    with pytest.raises(ConfigError, match="call nccl_ddp.init_process_group"):
        nd.all_reduce(np.zeros(3))
    with pytest.raises(ConfigError, match="init_process_group"):
        nd.get_rank()
    with pytest.raises(ConfigError, match="unknown backend"):
        nd.init_process_group(backend="mpi")  # torch's "gloo" is ours "host"


def test_single_process_world_picks_host_backend(single_process, caplog):
    with caplog.at_level(logging.INFO, logger="nccl_ddp.comm.api"):
        g = nd.init_process_group(timeout=10)
    assert g.backend == "host" and "backend 'host'" in caplog.text
    assert (nd.get_rank(), nd.get_world_size(), nd.get_local_rank()) == (0, 1, 0)
    x = np.arange(4, dtype=np.int16)
    assert nd.all_reduce(x, "avg") is x
    np.testing.assert_array_equal(x, np.arange(4))
    with pytest.raises(ConfigError, match="called twice"):
        nd.init_process_group(backend="host")
    nd.destroy_process_group()
    assert not nd.is_initialized()


def test_jax_arrays_come_back_as_new_jax_arrays(single_process):
    jnp = pytest.importorskip("jax.numpy")
    nd.init_process_group(backend="host", timeout=10)
    x = jnp.arange(4, dtype=jnp.float32)
    y = nd.all_reduce(x, "avg")
    assert type(y) is type(x) and y is not x
    np.testing.assert_array_equal(np.asarray(y), np.arange(4))


def api_body(rank, world):
    g = nd.init_process_group(backend="host", timeout=30)
    assert nd.is_initialized() and nd.get_world_group() is g
    assert (nd.get_rank(), nd.get_world_size(), nd.get_local_rank()) == (rank, world, rank)
    total = sum(r + 1 for r in range(world))

    x = np.full((3, 4), rank + 1.0, np.float32)
    assert nd.all_reduce(x) is x
    np.testing.assert_array_equal(x, total)
    y = np.array([rank, -rank], np.int32)
    nd.all_reduce(y, op="max")
    np.testing.assert_array_equal(y, [world - 1, 0])
    z = np.full(5, float(rank))
    nd.all_reduce(z, nd.ReduceOp.AVG)
    np.testing.assert_allclose(z, (world - 1) / 2)

    base = np.zeros((4, 6))  # a strided view is reduced in place
    view = base[:, ::2]
    view[...] = rank + 1
    assert nd.all_reduce(view) is view
    assert (base[:, ::2] == total).all() and (base[:, 1::2] == 0).all()

    ro = np.full(4, rank + 1.0)  # read-only: a new array comes back
    ro.flags.writeable = False
    out = nd.all_reduce(ro)
    assert out is not ro and (out == total).all() and (ro == rank + 1).all()

    works = [nd.all_reduce(np.full(2, rank + i), async_op=True) for i in range(3)]
    for i, w in reversed(list(enumerate(works))):
        assert isinstance(w, nd.Work)
        np.testing.assert_array_equal(w.result(), sum(r + i for r in range(world)))

    b = np.full(3, rank)
    nd.broadcast(b, src=world - 1)
    np.testing.assert_array_equal(b, world - 1)

    parts = [np.empty(2, np.int64) for _ in range(world)]
    assert nd.all_gather(parts, np.array([rank, 10 * rank])) is parts
    for r, p in enumerate(parts):
        np.testing.assert_array_equal(p, [r, 10 * r])
    flat = np.empty((world, 2))
    nd.all_gather(flat, np.full(2, float(rank)))
    np.testing.assert_array_equal(flat, np.repeat(np.arange(world), 2).reshape(world, 2))

    out = np.empty(2, np.int64)
    nd.reduce_scatter(out, [np.full(2, 10 * j + rank) for j in range(world)])
    np.testing.assert_array_equal(out, world * 10 * rank + sum(range(world)))
    nd.reduce_scatter(out, np.arange(2 * world) + rank, op="min")
    np.testing.assert_array_equal(out, [2 * rank, 2 * rank + 1])

    nd.barrier()
    assert nd.barrier(async_op=True).wait(10)

    with pytest.raises(ConfigError, match=f"rank {rank}: broadcast .*src rank 5"):
        nd.broadcast(b, src=5)
    with pytest.raises(ConfigError, match=f"has 1 arrays but the group has {world}"):
        nd.all_gather([np.empty(2)], np.zeros(2))
    with pytest.raises(ConfigTypeError, match=f"rank {rank}.*complex64 is not supported"):
        nd.all_reduce(np.zeros(2, np.complex64))
    with pytest.raises(ConfigError, match="must be a ProcessGroup"):
        nd.all_reduce(x, group="world")
    nd.destroy_process_group()
    assert not nd.is_initialized()


@pytest.mark.slow
def test_api_two_ranks():
    run_ranks(api_body, 2, timeout=90)


def new_group_body(rank, world):
    nd.init_process_group(backend="host", timeout=30)
    g = nd.new_group([0, 2])
    if rank == 1:
        assert not g and g.ranks == (0, 2)
        with pytest.raises(
            ConfigError,
            match="rank 1: all_reduce: this rank is not a member of "
            r"the group of ranks \[0, 2\]",
        ):
            nd.all_reduce(np.ones(2), group=g)
        with pytest.raises(ConfigError, match="not a member"):
            nd.DistributedDataParallel([np.ones(2, np.float32)], process_group=g)
    else:
        x = np.full(3, rank)
        nd.all_reduce(x, group=g)
        np.testing.assert_array_equal(x, 2)
        y = np.full(2, rank)
        nd.broadcast(y, src=2, group=g)
        np.testing.assert_array_equal(y, 2)
        with pytest.raises(ConfigError, match="src rank 1 is not a member"):
            nd.broadcast(y, src=1, group=g)
        g.shutdown()
    w = np.ones(1)
    nd.all_reduce(w)
    assert w[0] == world
    nd.destroy_process_group()


@pytest.mark.slow
def test_new_group_of_three():
    run_ranks(new_group_body, 3, timeout=90)


def torch_body(rank, world):
    import torch

    nd.init_process_group(backend="host", timeout=30)
    total = sum(r + 1 for r in range(world))
    t = torch.full((3, 2), float(rank + 1))
    assert nd.all_reduce(t) is t
    assert torch.equal(t, torch.full((3, 2), float(total)))
    p = torch.full((4,), float(rank + 1), requires_grad=True)  # a leaf that needs grad
    assert nd.all_reduce(p, "avg") is p
    assert torch.allclose(p.detach(), torch.full((4,), total / world))
    bf = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)  # NumPy's DLPack lacks bf16
    assert nd.all_reduce(bf) is bf and bf.dtype == torch.bfloat16
    assert torch.equal(bf.float(), torch.full((5,), float(total)))
    big = torch.zeros(4, 4)
    v = big[:, ::2]
    v.fill_(rank + 1)
    assert nd.all_reduce(v) is v
    assert (big[:, ::2] == total).all() and (big[:, 1::2] == 0).all()
    outs = [torch.empty(2) for _ in range(world)]
    ids = [id(o) for o in outs]
    nd.all_gather(outs, torch.tensor([rank, rank], dtype=torch.float32))
    assert [id(o) for o in outs] == ids
    for r, o in enumerate(outs):
        assert torch.equal(o, torch.full((2,), float(r)))
    w = nd.all_reduce(torch.ones(3), async_op=True)
    assert torch.equal(w.result(), torch.full((3,), float(world)))
    nd.destroy_process_group()


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.slow
def test_torch_cpu_tensors_in_place():
    run_ranks(torch_body, 2, timeout=120)


def _sockets() -> int:
    import os

    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the fd listing itself, closed since
            pass
    return sum(link.startswith("socket:") for link in links)


def destroy_after_peer_died_body(rank, world, dead, out_path):
    """Rank `dead` exits before a collective; the survivor catches the CommError and cleans up:
    destroy_process_group must not wait for the dead peer, and must release everything."""
    import json
    import os
    import threading
    import time

    from nccl_ddp.errors import CommError

    sockets = _sockets()
    nd.init_process_group(backend="host", timeout=20)
    nd.all_reduce(np.ones(4))  # the transport is set up and working
    if rank == dead:
        os._exit(3)
    try:
        nd.all_reduce(np.ones(1 << 16, np.float32))
    except CommError as e:
        caught = str(e)
    else:
        raise AssertionError(f"rank {rank} reduced without its peer")
    t0 = time.monotonic()
    nd.destroy_process_group()
    seconds = time.monotonic() - t0
    threads = [t.name for t in threading.enumerate() if t.name.startswith("nccl_ddp")]
    with open(out_path, "w") as f:
        json.dump(
            {
                "caught": caught,
                "seconds": seconds,
                "threads": threads,
                "sockets": [sockets, _sockets()],
                "initialized": nd.is_initialized(),
            },
            f,
        )


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0])
def test_destroy_after_a_peer_died_does_not_wait_for_it(tmp_path, dead):
    import json

    out = tmp_path / "survivor.json"
    failed = run_ranks(destroy_after_peer_died_body, 2, dead, str(out), timeout=60, expect_fail=True)
    assert set(failed) == {dead} and "exited with code 3" in failed[dead], failed
    got = json.loads(out.read_text())
    assert "all_reduce" in got["caught"] and f"peer rank {dead}" in got["caught"], got
    assert got["seconds"] < 5.0, got  # the store barrier would wait min(timeout, 30) s
    assert not got["initialized"] and got["threads"] == [], got
    assert got["sockets"][1] == got["sockets"][0], got  # store client/server, links: closed


def destroy_waits_for_peers_body(rank, world, tmp):
    """Without a failure, rank 0 (the store's host) leaves destroy_process_group only after
    every rank entered it: the store stays up while a peer may still need it."""
    import time

    nd.init_process_group(backend="host", timeout=20)
    nd.all_reduce(np.ones(4))
    if rank == 1:
        time.sleep(1.0)
        with open(f"{tmp}/entered", "w") as f:
            f.write(repr(time.time()))
    nd.destroy_process_group()
    if rank == 0:
        with open(f"{tmp}/left", "w") as f:
            f.write(repr(time.time()))


@pytest.mark.slow
def test_destroy_without_failure_keeps_its_barrier(tmp_path):
    run_ranks(destroy_waits_for_peers_body, 2, str(tmp_path), timeout=60)
    entered = float((tmp_path / "entered").read_text())
    left = float((tmp_path / "left").read_text())
    assert left >= entered, (left, entered)
