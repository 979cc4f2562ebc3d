"""Faults of the communication layer found by attacking the runtime (issue 13), each kept fixed by
a test that failed before: groups whose members or roots differ across ranks, the rendezvous
blaming the right peer, /dev/shm too small, destroy with a lost or late peer, NCCL's desync debug
mode and two ranks on one GPU (on the fake runtime), ranks that never arrive, a collective that
fails on one rank poisoning the group.

Multi-process cases run on loopback with a hard bound (tests/support/mp.py); the slow variants are
marked `slow`.
"""

import os
import threading
import time

import numpy as np
import pytest
from mp import free_port, outcome, run_ranks
from shm import shm_entries

import nccl_ddp as nd
from nccl_ddp.errors import CommError, ConfigError

f32 = np.float32


# -- silent wrong results ------------------------------------------------------------------------


def _disagree_on_members(rank, world, transport):
    import os

    os.environ["NCCL_DDP_HOST_TRANSPORT"] = transport
    nd.init_process_group("host", timeout=10)
    try:
        members = [0, 1] if rank == 0 else [1, 2]
        g = outcome(lambda: nd.new_group(members))
        if g[0] != "ok":
            return g
        x = np.full(2, 10.0**rank, f32)  # 1, 10, 100
        return outcome(lambda: nd.all_reduce(x, group=g[1]).tolist())
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_new_group_with_different_members_raises_instead_of_wrong_sums(transport):
    # before: rank 0's all_reduce returned 101.0 (it met rank 1 as "group rank 0"'s peer)
    r0, r1, r2 = run_ranks(_disagree_on_members, 3, transport, timeout=60)
    assert r0[0] == "RankMismatchError", r0
    assert "[0, 1]" in r0[1] and "[1, 2]" in r0[1] and r0[1].startswith("rank 0:"), r0
    assert r1 == r2 == ("ok", [110.0, 110.0]), (r1, r2)  # their group is consistent


def _broadcast_src_mismatch(rank, world, transport):
    import os

    os.environ["NCCL_DDP_HOST_TRANSPORT"] = transport
    nd.init_process_group("host", timeout=10)
    try:
        x = np.full(3, float(rank), f32)
        return outcome(lambda: nd.broadcast(x, src=0 if rank == 0 else 1).tolist())
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_broadcast_src_mismatch_fails_at_once_on_every_rank(transport):
    # before (tcp): every rank returned without error; the next collective failed under its name
    for rank, (kind, msg) in enumerate(run_ranks(_broadcast_src_mismatch, 3, transport, timeout=60)):
        assert kind in ("RankMismatchError", "CommError"), (rank, kind, msg)
        assert "broadcast" in msg, (rank, msg)
        assert "RankMismatch" in msg or kind == "RankMismatchError" or "gave up" in msg, msg


# -- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e10, float("inf"), 0, -1.0])
def test_init_process_group_timeout_out_of_range_is_a_config_error(timeout):
    # before: 1e10 passed the check and overflowed later (OverflowError: timeout value is too large)
    with pytest.raises(ConfigError, match="init_process_group: timeout"):
        nd.init_process_group("host", timeout=timeout, rank=0, world_size=1)
    assert not nd.is_initialized()


def test_refused_connection_at_setup_blames_the_peer():
    """A rank killed at setup leaves a published address nobody listens on: the survivor's
    CommError must blame it, or the launcher may name the survivor as the root cause (seen in
    test_chaos_matrix[2-shm-setup-KILL]: 'cannot connect to rank 0' matched no blame)."""
    import socket

    from nccl_ddp.comm.host.rendezvous import Rendezvous
    from nccl_ddp.job.failure_record import blamed_rank

    with socket.socket() as s:  # a port that was just free: connecting is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdv = Rendezvous.__new__(Rendezvous)
    rdv.infos = [{"addr": "127.0.0.1", "port": port, "token": "0" * 32}, {}]
    rdv.rank, rdv.ranks, rdv.where, rdv.timeout = 1, [4, 5], "group 'world' (rank 5)", 5.0
    rdv._left = lambda: 5.0
    with pytest.raises(CommError, match="cannot connect to peer rank 4") as e:
        rdv._dial(0)
    assert blamed_rank(e.value) == 4


def test_dialing_peer_retries_a_handshake_the_acceptor_dropped():
    """The acceptor confirms a valid handshake; a dialer whose connection was dropped before
    that (evicted among strangers, or past HANDSHAKE_DEADLINE on a starved machine) dials again
    (before: it kept the dead socket and failed later with 'peer rank 4 closed the connection')."""
    import socket

    from nccl_ddp.comm.host.rendezvous import _HANDSHAKE, Rendezvous

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    rdv = Rendezvous.__new__(Rendezvous)
    rdv.infos = [{"addr": "127.0.0.1", "port": srv.getsockname()[1], "token": "a" * 32}, {}]
    rdv.rank, rdv.ranks, rdv.where, rdv.timeout = 1, [4, 5], "group 'world' (rank 5)", 10.0
    rdv.deadline = time.monotonic() + 10.0
    rdv._left = lambda: 10.0
    seen: list = []

    def acceptor():
        for confirm in (False, True):
            conn, _ = srv.accept()
            conn.settimeout(10)
            seen.append(_HANDSHAKE.unpack(conn.recv(_HANDSHAKE.size)))
            if confirm:
                conn.sendall(b"\x01" + b"data")
                time.sleep(0.5)
            conn.close()

    t = threading.Thread(target=acceptor)
    t.start()
    try:
        link = rdv._dial(0)
        buf = bytearray(4)
        link.recv_into(memoryview(buf))
        assert bytes(buf) == b"data" and link.peer == 4
        link.close()
    finally:
        t.join(15)
        srv.close()
    assert seen == [(b"a" * 32, 1)] * 2, seen


# -- /dev/shm too small (issue 22 item 9) ---------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount permission; else the test is skipped)."""
    import subprocess

    d = tmp_path / "shm"
    d.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_segment_that_does_not_fit_in_shm_is_a_comm_error_at_creation(small_tmpfs, monkeypatch):
    # before: created sparse, and the first write past the free space killed with SIGBUS
    from nccl_ddp.comm.host import segment

    monkeypatch.setattr(segment, "SHM_DIR", str(small_tmpfs))
    with pytest.raises(CommError) as e:
        segment.Segment.create(4 << 20)
    msg = str(e.value)
    assert "4.0 MiB (4194304 bytes) does not fit" in msg and "need 4.0 MiB" in msg, msg
    assert "has 1.0 MiB (1048576 bytes) free" in msg and "NCCL_DDP_HOST_TRANSPORT=tcp" in msg, msg
    assert os.listdir(small_tmpfs) == []  # nothing left behind
    seg = segment.Segment.create(256 << 10)  # what fits still works
    seg.array[:] = 1
    seg.close()


def _shm_full_on_rank0(rank, world):
    import errno

    if rank == 0:  # /dev/shm fills up as rank 0 allocates (rank 1 got its room)

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.posix_fallocate = full
    os.environ["NCCL_DDP_HOST_TRANSPORT"] = "shm"
    got = outcome(lambda: nd.init_process_group("host", timeout=10) and None)
    if got[0] == "ok":
        nd.destroy_process_group()
    return got


@pytest.mark.slow
def test_shm_too_small_fails_setup_on_every_rank_naming_the_fix():
    job = f"t{os.getpid()}full"  # our segments' names, apart from other jobs'
    (k0, m0), (k1, m1) = run_ranks(_shm_full_on_rank0, 2, timeout=60, env={"NCCL_DDP_JOB_ID": job})
    assert k0 == "CommError" and "is too small for the shm transport" in m0, (k0, m0)
    assert "2 rank(s) on this host need" in m0 and "NCCL_DDP_HOST_TRANSPORT=tcp" in m0, m0
    # rank 1 fails too, with rank 0's reason rather than "peer rank 0 closed the connection"
    assert k1 == "CommError" and "peer rank 0 gave up" in m1, (k1, m1)
    assert "NCCL_DDP_HOST_TRANSPORT=tcp" in m1, m1
    assert [n for n in shm_entries() if n.startswith(f"nccl_ddp-{job}-")] == []


def _exit_without_destroy(rank, world):
    nd.init_process_group("host", timeout=20)
    nd.all_reduce(np.ones(4, f32))
    if rank == 1:
        return None  # exits without destroy_process_group
    time.sleep(0.5)
    t0 = time.monotonic()
    nd.destroy_process_group()
    return time.monotonic() - t0


@pytest.mark.slow
def test_destroy_does_not_wait_for_a_rank_that_exited():
    # before: rank 0 waited for the destroy barrier until its timeout (20 s here, 30 s at most)
    elapsed = run_ranks(_exit_without_destroy, 2, timeout=60)[0]
    assert elapsed < 8, elapsed


def test_lost_peer_check_does_not_block_on_a_live_quiet_peer():
    # issue 22 item 2's cause: before, the check waited the link's whole timeout (5 s here) for
    # data from a live peer that had nothing to say, then reported it lost
    import socket

    from nccl_ddp.comm.host.wire import PeerLink

    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname(), timeout=5)
        a, _ = srv.accept()
    link = PeerLink(a, 1, timeout=5.0)
    try:
        t0 = time.monotonic()
        assert link.closed_by_peer() is False
        assert time.monotonic() - t0 < 2.5  # half the timeout: it did not wait for one
        b.sendall(b"x")
        assert link.closed_by_peer() is False  # data pending: alive
        b.close()
        link.recv_into(memoryview(bytearray(1)))
        assert link.closed_by_peer() is True  # hung up
    finally:
        link.close()
        b.close()


def _staggered_destroy(rank, world, gap):
    nd.init_process_group("host", timeout=12)
    nd.all_reduce(np.ones(4, f32))
    time.sleep(gap * rank)  # rank r reaches destroy r * gap seconds late
    t0 = time.monotonic()
    nd.destroy_process_group()
    return time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_destroy_with_staggered_ranks_waits_for_the_last_not_a_timeout_per_peer(world):
    # issue 22 item 2 (no launcher: rank 0 hosts the store). Before: the lost-peer check peeked a
    # socket that has a timeout, so it blocked the whole timeout (12 s) per live peer and then
    # called it lost: rank 0 took 12 s at world 2, 24 s at world 3. The slowest rank arrives
    # (world - 1) * 1.5 s after rank 0; 6 s of slack for a loaded machine is still half a timeout.
    gap = 1.5
    elapsed = run_ranks(_staggered_destroy, world, gap, timeout=120)
    assert elapsed[0] < (world - 1) * gap + 6, elapsed
    assert max(elapsed) < (world - 1) * gap + 6, elapsed


# -- NCCL: desync debug mode and two ranks on one GPU (on the fake runtime) -----------------------


def _nccl_group(rank, world, rt, timeout=10.0):
    """(store, group, error): the group built through a real store on the fake runtime."""
    from nccl_ddp.comm.nccl import backend as nb
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import PrefixStore, connect_store

    store = connect_store(resolve_env(), timeout=30)
    try:
        return store, nb.NcclProcessGroup.create(
            PrefixStore(store, "t"), rank, world, range(world), timeout, "world", 0, runtime=rt
        )
    except Exception:
        store.barrier("failed", world, timeout=30)  # rank 0 hosts the store: leave together
        store.close()
        raise


def _launched(rt):
    return [c[0] for c in rt.comms[0].calls]


def _desync(rank, world, cases, debug):
    """{case: (what the mismatched call did, what the next matching call did, NCCL calls made)}."""
    from fake_nccl import FakeRuntime

    if debug:
        os.environ["NCCL_DDP_DEBUG"] = "DETAIL"
    rt = FakeRuntime()
    store, g = _nccl_group(rank, world, rt, timeout=3.0)
    results = {}
    try:
        for case in cases:
            buf = np.ones(4, f32)
            g.all_reduce(buf)  # the same everywhere: passes
            before = len(_launched(rt))
            if case == "op":
                got = outcome(lambda b=buf: (g.all_reduce if rank == 0 else g.broadcast)(b))
            elif case == "count":
                got = outcome(lambda: g.all_reduce(np.ones(4 + (rank == world - 1), f32)))
            elif case == "root":
                got = outcome(lambda b=buf: g.broadcast(b, root=0 if rank == 0 else 1))
            elif case == "dtype":
                dt = f32 if rank else np.float64
                got = outcome(lambda d=dt: g.all_gather(np.ones(world * 2, d), np.ones(2, d)))
            else:  # "missing": rank 1 skips one
                got = ("skipped", "") if rank == 1 else outcome(lambda: g.barrier())
            launched = len(_launched(rt)) - before
            after = (
                ("ok", None) if case == "missing" else outcome(lambda: g.all_reduce(np.ones(2, f32)) and None)
            )
            got = (got[0], got[1] if isinstance(got[1], str) else None)  # a Work does not pickle
            results[case] = got, after, launched
        return results
    finally:
        g.shutdown()
        store.barrier("done", world, timeout=30)
        store.close()


DESYNCS = ["op", "count", "root", "dtype"]


@pytest.mark.slow
def test_nccl_debug_detail_catches_a_desync_on_every_rank():
    # before: NCCL ran whatever it was given (a real GPU hangs or reduces garbage)
    world = 3
    for rank, results in enumerate(run_ranks(_desync, world, DESYNCS, True, timeout=90)):
        for seq, case in enumerate(DESYNCS):
            (kind, msg), after, launched = results[case]
            assert kind == "RankMismatchError", (rank, case, kind, msg)
            n = 3 * seq + 2  # each case: a matching call, the mismatch, a matching call
            assert f"rank {rank}: collective #{n} of group 'world' differs across ranks" in msg, msg
            assert after == ("ok", None), after  # the group is still usable
            assert launched == 0, (case, launched)  # the mismatch never reached NCCL


@pytest.mark.slow
def test_nccl_debug_off_by_default_runs_mismatches_unchecked():
    for results in run_ranks(_desync, 2, ["op"], False, timeout=90):
        got, _, launched = results["op"]
        assert got[0] == "ok" and launched == 1, (got, launched)


@pytest.mark.slow
def test_nccl_debug_detail_names_a_rank_that_skipped_a_collective():
    results = run_ranks(_desync, 3, ["missing"], True, timeout=90)
    for rank in (0, 2):
        kind, msg = results[rank]["missing"][0]
        assert kind == "CommTimeout" and "rank 1 did not reach collective #2" in msg, msg


def _shared_gpu(rank, world):
    from fake_nccl import FakeRuntime

    rt = FakeRuntime()
    rt.device_uuid = lambda: "gpu-b" if rank in (0, 2) else f"gpu-{rank}"
    try:
        store, g = _nccl_group(rank, world, rt)
    except Exception as e:  # the test asserts on it
        return type(e).__name__, str(e), len(rt.comms)
    g.shutdown()
    store.close()
    return "ok", "", len(rt.comms)


@pytest.mark.slow
def test_two_ranks_on_one_gpu_is_a_config_error_before_the_communicator():
    # before: NCCL itself refused them with an unhelpful message (or hung)
    for rank, (kind, msg, comms) in enumerate(run_ranks(_shared_gpu, 3, timeout=90)):
        assert kind == "ConfigError", (rank, kind, msg)
        assert f"rank {rank}: ranks 0 and 2 would both use GPU 0 (UUID gpu-b)" in msg, msg
        assert "CUDA_VISIBLE_DEVICES" in msg and comms == 0


# -- a launcher environment that counts more processes than run (issue 30, item 6) ---------------

_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "MS_", "TORCHELASTIC_", "NCCL_DDP_STORE")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "RANK_ID")
_LAUNCHER_NAMES += ("RANK_SIZE", "DEVICE_ID", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_never_arrive_are_named_every_period_with_the_world_size_source(rank, monkeypatch, caplog):
    """Open MPI's variables say 2 processes; 1 runs (rank 0, which hosts the store, or rank 1,
    which waits for it). Before: it waited the whole timeout without a word (300 s by default).
    Now a WARNING every NOTICE_EVERY seconds (30; 0.3 here) names what is missing and where the
    world size came from, and so does the final error."""
    from nccl_ddp.comm.host import rendezvous
    from nccl_ddp.errors import CommTimeout, StoreTimeout
    from nccl_ddp.store import client

    for k in list(os.environ):
        if k in _LAUNCHER_NAMES or k.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in (("RANK", rank), ("SIZE", 2), ("LOCAL_RANK", rank), ("LOCAL_SIZE", 2)):
        monkeypatch.setenv(f"OMPI_COMM_WORLD_{k}", str(v))
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for module in (rendezvous, client):  # (raising=False: so the old code ran)
        monkeypatch.setattr(module, "NOTICE_EVERY", 0.3, raising=False)
    caplog.set_level("WARNING", logger="nccl_ddp")
    with pytest.raises((CommTimeout, StoreTimeout)) as info:
        nd.init_process_group("host", timeout=2.0)
    assert not nd.is_initialized()
    source = "world size 2 from OMPI_COMM_WORLD_SIZE=2 (Open MPI)"
    if rank == 0:
        waiting, tail = "still waiting for ranks [1]", f"(1 of 2 joined; {source})"
        assert "ranks [1] did not join within 2.0s" in str(info.value)
    else:
        waiting = f"rank 1: still waiting to connect to the store at 127.0.0.1:{port}"
        tail = f"; rank 0 hosts it; {source}"
    notes = [r.getMessage() for r in caplog.records if waiting in r.getMessage()]
    assert len(notes) >= 2, [r.getMessage() for r in caplog.records]
    assert all(tail in n for n in notes), notes
    assert all(r.levelname == "WARNING" for r in caplog.records)
    assert source in str(info.value), info.value


# -- a collective that fails on one rank poisons the group (issue 30, item 7) --------------------


def _refused_on_rank0(rank, world):
    """Rank 0's second all_reduce is refused (an unknown op); it catches the error and goes on.
    What each rank's calls gave."""
    nd.init_process_group("host", timeout=10)
    try:
        seen = [outcome(lambda: nd.all_reduce(np.full(2, rank + 1.0, f32)).tolist())]
        if rank == 0:
            seen.append(outcome(lambda: nd.all_reduce(np.full(2, 10.0, f32), op="median")))
        else:
            seen.append(outcome(lambda: nd.all_reduce(np.full(2, 10.0, f32)).tolist()))
        for step in (100.0, 1000.0):  # rank 0 goes on as if nothing happened
            seen.append(outcome(lambda: nd.all_reduce(np.full(2, step, f32)).tolist()))
        return seen
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("transport, world", [("shm", 2), ("tcp", 2), ("tcp", 3)])
def test_collective_refused_on_one_rank_poisons_the_group_on_every_rank(transport, world):
    """Before: rank 0's next all_reduce paired with the others' refused one (2 ranks: both got
    [110, 110], the sum of two different steps), and the last one waited for its timeout. Now
    the refusal poisons the group: every later collective, on every rank (through the TCP ring's
    neighbours too), raises naming rank 0, the op and the reason."""
    first = "rank 0: all_reduce on group 'world' was refused on this rank"
    results = run_ranks(_refused_on_rank0, world, timeout=90, env={"NCCL_DDP_HOST_TRANSPORT": transport})
    for rank, seen in enumerate(results):
        assert seen[0] == ("ok", [sum(range(1, world + 1))] * 2), seen
        later = seen[2:] if rank == 0 else seen[1:]
        if rank == 0:
            assert seen[1][0] == "ConfigError" and "unknown reduce op 'median'" in seen[1][1], seen
        for kind, msg in later:
            assert kind == "CommError", (rank, seen)
            assert first in msg and "unknown reduce op 'median'" in msg, (rank, msg)
