"""Faults found by attacking the runtime (issue 13), each kept fixed by a test that failed before.

Multi-process cases run on loopback with a hard bound (tests/mp.py); the slow variants are
marked `slow`.
"""
import os
import threading
import time

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError

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


# -- the store: a local process without the secret must not break a job --------------------------


@pytest.fixture
def store_server():
    from nccl_ddp.store.client import StoreServer
    s = StoreServer("127.0.0.1", 0, "secret")
    yield s
    s.close()


def _store_serves(port, key="alive"):
    """A fresh authenticated client can connect and use the store (the leak check's last item)."""
    from nccl_ddp.store.client import TCPStore
    with TCPStore("127.0.0.1", port, "secret", timeout=10) as c:
        c.set(key, b"1")
        return c.get(key, timeout=5) == b"1"


def _greeted(port):
    import socket

    from nccl_ddp.store.wire import _recv_frame
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    _recv_frame(s)                   # the server's greeting: it has accepted us
    return s


def test_store_keeps_accepting_after_running_out_of_descriptors(store_server):
    # before: one EMFILE in accept() ended the accept loop for good; no rank could join after
    import resource
    import socket
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    idle = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 60, hard))
    try:
        for _ in range(200):         # each costs 2 descriptors here: the server runs out
            try:
                idle.append(socket.create_connection(("127.0.0.1", store_server.port), timeout=2))
            except OSError:
                break
        time.sleep(0.5)              # the server hits EMFILE, drops the oldest strangers, retries
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert _store_serves(store_server.port)
    finally:
        for s in idle:
            s.close()


def test_store_closes_an_oversized_frame_before_authentication(store_server):
    # before: a stranger announcing a 64 MiB frame made the server buffer up to 64 MiB for it
    import struct
    s = _greeted(store_server.port)
    s.sendall(struct.pack(">I", 64 << 20) + b"x" * 1000)
    s.settimeout(5)
    assert s.recv(16) == b""         # closed at once, not after the handshake deadline
    s.close()
    assert _store_serves(store_server.port)


def test_store_caps_and_times_out_unauthenticated_connections(monkeypatch):
    from nccl_ddp.store import server as srv
    monkeypatch.setattr(srv, "MAX_UNAUTHENTICATED", 20)
    monkeypatch.setattr(srv, "HANDSHAKE_DEADLINE", 1.0)
    with srv.StoreServer("127.0.0.1", 0, "secret") as server:
        socks = [_greeted(server.port) for _ in range(30)]
        time.sleep(0.2)
        assert server.connections == 20            # the oldest 10 were dropped
        for s in socks[:10]:
            s.settimeout(2)
            assert s.recv(16) == b""
        t0 = time.monotonic()
        socks[-1].settimeout(5)
        assert socks[-1].recv(16) == b""           # the handshake deadline closes the rest
        assert time.monotonic() - t0 < 4
        assert _store_serves(server.port)
        for s in socks:
            s.close()


def test_store_serves_many_idle_connections_from_one_thread(store_server):
    # before: one thread per connection (3,000 idle sockets made 3,009 threads)
    from nccl_ddp.store.client import TCPStore
    before = threading.active_count()
    clients = [TCPStore("127.0.0.1", store_server.port, "secret", timeout=10) for _ in range(200)]
    try:
        assert threading.active_count() == before
        clients[0].set("k", b"v")
        assert all(c.get("k", timeout=5) == b"v" for c in clients[::20])
    finally:
        for c in clients:
            c.close()


# -- the launcher: nothing of a job outlives it, and the right rank is blamed ---------------------

from test_launch import _run, _script, _wait_gone  # noqa: E402


def _shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("nccl_ddp-")}


def _start_launcher(tmp_path, script, *args, nproc=2):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_DDP_SECRET")}
    return subprocess.Popen([sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node",
                             str(nproc), "--grace-period", "2", script, str(tmp_path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_files(proc, files, timeout=30):
    deadline = time.monotonic() + timeout
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
        time.sleep(0.05)


# Each worker maps a segment of its own (as shm setup does) and a child process, then waits.
HOLDS_SHM = """
    import os, subprocess, sys, time
    from nccl_ddp.comm.host.shm import Segment
    seg = Segment.create(4096, "host")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    rank = os.environ["RANK"]
    open(os.path.join(sys.argv[1], "pids" + rank), "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_launcher_killed_leaves_no_worker_and_no_segment(tmp_path, how):
    # before: SIGTERM left each worker's segment in /dev/shm; SIGKILL also left the workers
    # running (still alive 40 s later)
    import signal
    before = _shm_names()
    proc = _start_launcher(tmp_path, _script(tmp_path, HOLDS_SHM))
    try:
        files = [tmp_path / "pids0", tmp_path / "pids1"]
        _wait_files(proc, files)
        pids = [int(p) for f in files for p in f.read_text().split()]
        assert len(_shm_names() - before) == 2
        proc.send_signal(getattr(signal, how))
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert _wait_gone(pids, timeout=10) == [], "workers or their children outlived the launcher"
    deadline = time.monotonic() + 5
    while _shm_names() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _shm_names() - before == set()
    if how == "SIGKILL":
        assert "the launcher (pid" in err and "killed their 2 process group(s)" in err, err


KILLED_MID_ALL_REDUCE = """
    import os, signal, sys, time
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group("host", timeout=30)
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # rank 0 always fails on its own, naming rank 1
    for step in range(1000):
        if rank == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        nd.all_reduce(np.ones(1 << 16, np.float32))
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_launcher_names_the_killed_rank_not_the_survivor(tmp_path, transport):
    # before: 6 of 16 runs said rank 0 (which raised CommError naming rank 1) "failed first"
    r = _run(["--nproc-per-node", "2", "--grace-period", "2",
              _script(tmp_path, KILLED_MID_ALL_REDUCE)],
             env={"NCCL_DDP_HOST_TRANSPORT": transport}, timeout=90)
    assert r.returncode == 128 + 9, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("nccl-ddp-run:")]
    root = next(ln for ln in lines if "root cause" in ln)
    assert root.endswith("root cause: rank 1 (local rank 1): killed by signal SIGKILL"), lines
    then = [ln for ln in lines if "  then rank 0 (local rank 0): exit code 1: " in ln]
    assert then and "[blames rank 1]" in then[0], lines


def test_launcher_splits_an_endless_line(tmp_path):
    # before: a line without a newline was buffered whole (two 300 MiB lines: 1.46 GiB)
    script = _script(tmp_path, """
        import sys
        sys.stdout.write("x" * (200 << 10))
        sys.stdout.flush()
        print("end")
    """)
    r = _run(["--nproc-per-node", "1", script])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= (64 << 10) + 100
    assert sum(ln.count("x") for ln in lines) == 200 << 10
    assert sum("line split at 64 KiB" in ln for ln in lines) == 3, [ln[-60:] for ln in lines]
    assert lines[-1] == "[rank 0] " + "x" * ((200 << 10) - 3 * (64 << 10)) + "end"


def _exit_without_destroy(rank, world):
    nd.init_process_group("host", timeout=20)
    nd.all_reduce(np.ones(4, f32))
    if rank == 1:
        return None                          # exits without destroy_process_group
    time.sleep(0.5)
    t0 = time.monotonic()
    nd.destroy_process_group()
    return time.monotonic() - t0


def test_destroy_does_not_wait_for_a_rank_that_exited():
    # before: rank 0 waited for the destroy barrier until its timeout (20 s here, 30 s at most)
    elapsed = run_ranks(_exit_without_destroy, 2, timeout=60)[0]
    assert elapsed < 8, elapsed


# -- NCCL: desync debug mode and two ranks on one GPU (on the fake runtime) -----------------------


def _nccl_group(rank, world, rt, timeout=10.0):
    """(store, group, error): the group built through a real store on the fake runtime."""
    from nccl_ddp.comm.nccl import backend as nb
    from nccl_ddp.env import resolve_env
    from nccl_ddp.store.client import PrefixStore, connect_store
    store = connect_store(resolve_env(), timeout=30)
    try:
        return store, nb.NcclProcessGroup.create(PrefixStore(store, "t"), rank, world,
                                                 range(world), timeout, "world", 0, runtime=rt)
    except Exception:
        store.barrier("failed", world, timeout=30)    # rank 0 hosts the store: leave together
        store.close()
        raise


def _launched(rt):
    return [c[0] for c in rt.comms[0].calls]


def _desync(rank, world, case, debug):
    from test_nccl_backend import FakeRuntime
    if debug:
        os.environ["NCCL_DDP_DEBUG"] = "DETAIL"
    rt = FakeRuntime()
    store, g = _nccl_group(rank, world, rt, timeout=3.0)
    try:
        buf = np.ones(4, f32)
        g.all_reduce(buf)                               # the same everywhere: passes
        if case == "op":
            got = _outcome(lambda: (g.all_reduce if rank == 0 else g.broadcast)(buf))
        elif case == "count":
            got = _outcome(lambda: g.all_reduce(np.ones(4 + (rank == world - 1), f32)))
        elif case == "root":
            got = _outcome(lambda: g.broadcast(buf, root=0 if rank == 0 else 1))
        elif case == "dtype":
            got = _outcome(lambda: g.all_gather(np.ones(world * 2, f32 if rank else np.float64),
                                                np.ones(2, f32 if rank else np.float64)))
        else:                                           # "missing": rank 1 skips one
            got = ("skipped", "") if rank == 1 else _outcome(lambda: g.barrier())
        after = _outcome(lambda: g.all_reduce(np.ones(2, f32)) and None) if case != "missing" \
            else ("ok", None)
        got = (got[0], got[1] if isinstance(got[1], str) else None)   # a Work does not pickle
        return got, after, _launched(rt)
    finally:
        g.shutdown()
        store.barrier("done", world, timeout=30)
        store.close()


@pytest.mark.parametrize("case", ["op", "count", "root", "dtype"])
def test_nccl_debug_detail_catches_a_desync_on_every_rank(case):
    # before: NCCL ran whatever it was given (a real GPU hangs or reduces garbage)
    world = 3
    for rank, (got, after, launched) in enumerate(run_ranks(_desync, world, case, True,
                                                            timeout=90)):
        kind, msg = got
        assert kind == "RankMismatchError", (rank, got)
        assert f"rank {rank}: collective #2 of group 'world' differs across ranks" in msg, msg
        assert after == ("ok", None), after                 # the group is still usable
        assert len(launched) == 2, launched                 # the mismatched one never reached NCCL


def test_nccl_debug_off_by_default_runs_mismatches_unchecked():
    for got, _, launched in run_ranks(_desync, 2, "op", False, timeout=90):
        assert got[0] == "ok" and len(launched) == 3, (got, launched)


def test_nccl_debug_detail_names_a_rank_that_skipped_a_collective():
    results = run_ranks(_desync, 3, "missing", True, timeout=90)
    for rank in (0, 2):
        kind, msg = results[rank][0]
        assert kind == "CommTimeout" and "rank 1 did not reach collective #2" in msg, msg


def _shared_gpu(rank, world):
    from test_nccl_backend import FakeRuntime
    rt = FakeRuntime()
    rt.device_uuid = lambda: "gpu-b" if rank in (0, 2) else f"gpu-{rank}"
    try:
        store, g = _nccl_group(rank, world, rt)
    except Exception as e:  # the test asserts on it
        return type(e).__name__, str(e), len(rt.comms)
    g.shutdown()
    store.close()
    return "ok", "", len(rt.comms)


def test_two_ranks_on_one_gpu_is_a_config_error_before_the_communicator():
    # before: NCCL itself refused them with an unhelpful message (or hung)
    for rank, (kind, msg, comms) in enumerate(run_ranks(_shared_gpu, 3, timeout=90)):
        assert kind == "ConfigError", (rank, kind, msg)
        assert f"rank {rank}: ranks 0 and 2 would both use GPU 0 (UUID gpu-b)" in msg, msg
        assert "CUDA_VISIBLE_DEVICES" in msg and comms == 0
