import socket
import struct
import threading
import time

import pytest
from mp import free_port, run_ranks

from nccl_ddp.errors import AuthError, StoreError, StoreTimeout
from nccl_ddp.job.env import resolve_env
from nccl_ddp.store.client import MAX_FRAME, PrefixStore, StoreServer, TCPStore, connect_store


@pytest.fixture
def server():
    s = StoreServer("127.0.0.1", 0, "secret")
    yield s
    s.close()


@pytest.fixture
def client(server):
    c = TCPStore("127.0.0.1", server.port, "secret", timeout=10)
    yield c
    c.close()


# ---- multi-process: every op across ranks through connect_store --------------------------------


def _ops(rank, world_size):
    store = connect_store(resolve_env(), timeout=30)
    try:
        store.set(f"hello/{rank}", f"from {rank}")
        got = [store.get(f"hello/{r}") for r in range(world_size)]
        store.wait([f"hello/{r}" for r in range(world_size)])
        counts = [store.add("counter", 1) for _ in range(50)]
        store.barrier("after-add", world_size)
        total = int(store.get("counter"))
        won = store.compare_set("leader", "", str(rank)) == str(rank).encode()
        store.barrier("after-add", world_size)  # same name again
        leader = store.get("leader")
        group = PrefixStore(store, "group1")
        group.set("x", str(rank))
        group.barrier("b", world_size)
        prefixed = store.get("group1/x")
        store.barrier("end", world_size)
        return got, counts, total, won, leader, prefixed
    finally:
        store.close()


def test_ops_across_three_processes():
    results = run_ranks(_ops, 3, timeout=60)
    assert sum(r[3] for r in results) == 1  # one rank won the compare_set
    for got, counts, total, _won, leader, prefixed in results:
        assert got == [b"from 0", b"from 1", b"from 2"]
        assert counts == sorted(counts) and len(set(counts)) == 50
        assert total == 150
        assert int(leader) in (0, 1, 2)
        assert prefixed in (b"0", b"1", b"2")
    assert sum(won for *_, won, _, _ in results) == 1
    all_counts = [c for r in results for c in r[1]]
    assert sorted(all_counts) == list(range(1, 151))  # add is atomic: no value handed out twice


def _hosted_externally(rank, world_size):
    store = connect_store(resolve_env(), timeout=20)
    try:
        store.barrier("b", world_size)
        return store.add("n", 1)
    finally:
        store.close()


def test_store_hosted_by_someone_else():
    port = free_port()
    with StoreServer("127.0.0.1", port, "s") as srv:
        env = {"MASTER_PORT": str(port), "NCCL_DDP_SECRET": "s", "NCCL_DDP_STORE_HOSTED": "1"}
        results = run_ranks(_hosted_externally, 2, timeout=60, env=env)
        assert sorted(results) == [1, 2]
        assert srv.port == port


# ---- single-process semantics -----------------------------------------------------------------


def test_blocking_get_wakes_up_and_times_out_naming_the_key(client, server):
    other = TCPStore("127.0.0.1", server.port, "secret", timeout=10)
    threading.Timer(0.2, other.set, args=("late", b"v")).start()
    assert client.get("late", timeout=5) == b"v"
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="'never'"):
        client.get("never", timeout=0.3)
    assert time.monotonic() - t0 < 8  # the client's own timeout is 10 s
    with pytest.raises(StoreTimeout, match="missing-1"):
        client.wait(["late", "missing-1"], timeout=0.2)
    other.close()


def test_add_is_atomic_under_threads(server):
    clients = [TCPStore("127.0.0.1", server.port, "secret", timeout=10) for _ in range(4)]
    seen = []

    def bump(c):
        seen.extend(c.add("n", 1) for _ in range(200))

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == list(range(1, 801))
    assert clients[0].add("n", 0) == 800
    for c in clients:
        c.close()


def test_compare_set_and_delete(client):
    assert client.compare_set("k", "", "a") == b"a"  # missing + expected "" -> set
    assert client.compare_set("k", "zz", "b") == b"a"  # mismatch -> unchanged, current back
    assert client.compare_set("k", "a", "b") == b"b"
    assert client.compare_set("absent", "x", "y") == b""  # missing + expected non-empty -> not set
    assert client.delete("k") is True
    assert client.delete("k") is False
    client.set("text", "é")
    assert client.get("text") == "é".encode()
    with pytest.raises(StoreError, match="not an integer"):
        client.add("text", 1)
    assert client.add("fresh", 5) == 5  # connection still usable


def test_barrier_reused_and_times_out(server, client):
    other = TCPStore("127.0.0.1", server.port, "secret", timeout=10)
    for _ in range(3):
        t = threading.Thread(target=other.barrier, args=("same", 2))
        t.start()
        client.barrier("same", 2, timeout=10)
        t.join(10)
        assert not t.is_alive()
    with pytest.raises(StoreTimeout, match=r"'lonely'.*1 of 2"):
        client.barrier("lonely", 2, timeout=0.2)
    other.close()


def test_thread_safe_client(client):
    def work(i):
        for j in range(50):
            client.set(f"t{i}/{j}", str(j))
            assert client.get(f"t{i}/{j}") == str(j).encode()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert client.get("t3/49") == b"49"


# ---- authentication and robustness ------------------------------------------------------------


@pytest.mark.parametrize("secret", ["", "wrong"])
def test_auth_refused_while_good_client_keeps_working(server, client, secret, caplog):
    client.set("k", b"v")
    with caplog.at_level("WARNING", logger="nccl_ddp.store"):
        with pytest.raises(AuthError, match="NCCL_DDP_SECRET"):
            TCPStore("127.0.0.1", server.port, secret, timeout=5)
        time.sleep(0.1)
    assert any("refused a client from 127.0.0.1" in r.getMessage() for r in caplog.records)
    assert client.get("k") == b"v"


def _raw_authenticated_socket(port, secret=b"secret"):
    """A socket past the handshake, for sending hand-made frames."""
    from nccl_ddp.store.wire import _encode, _proof, _recv_frame

    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = _recv_frame(sock)
    sock.sendall(_encode([b"auth", b"n" * 32, _proof(secret, b"c", hello[1], b"n" * 32)]))
    assert _recv_frame(sock)[0] == b"ok"
    return sock


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(">I", MAX_FRAME + 1),  # oversized
        struct.pack(">I", 8) + struct.pack(">I", 100) + b"abcd",  # field longer than its frame
        struct.pack(">I", 7) + struct.pack(">I", 3) + b"zap",  # unknown op
        struct.pack(">I", 7) + struct.pack(">I", 3) + b"set",  # wrong argument count
    ],
    ids=["oversized", "truncated-field", "unknown-op", "bad-arity"],
)
def test_bad_frame_closes_only_that_connection(server, client, frame):
    sock = _raw_authenticated_socket(server.port)
    sock.sendall(frame)
    assert sock.recv(16) == b""  # server closed it
    sock.close()
    client.set("still", b"fine")
    assert client.get("still") == b"fine"
    assert TCPStore("127.0.0.1", server.port, "secret", timeout=5).add("x", 1) == 1


def test_garbage_before_handshake_is_dropped(server, client):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"\xff" * 64)
        sock.settimeout(5)
        data = sock.recv(4096)  # greeting, then EOF
        while data:
            data = sock.recv(4096)
    assert client.add("y", 2) == 2


def test_connect_to_dead_port_times_out_naming_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match=f"127.0.0.1:{port}.*MASTER_ADDR/MASTER_PORT"):
        TCPStore("127.0.0.1", port, "s", timeout=0.5)
    assert time.monotonic() - t0 < 15  # bounded by the 0.5 s timeout, not hanging


def test_connect_retries_until_server_starts():
    port = free_port()
    holder = {}
    threading.Timer(0.3, lambda: holder.setdefault("s", StoreServer("127.0.0.1", port, "s"))).start()
    c = TCPStore("127.0.0.1", port, "s", timeout=10)
    assert c.add("a", 1) == 1
    c.close()
    holder["s"].close()


def test_losing_the_server_raises_store_error():
    s = StoreServer("127.0.0.1", 0, "s")
    c = TCPStore("127.0.0.1", s.port, "s", timeout=5)
    waiter_error = []

    def blocked():
        other = TCPStore("127.0.0.1", s.port, "s", timeout=5)
        try:
            other.get("never", timeout=30)
        except StoreError as e:
            waiter_error.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    s.close()
    t.join(10)
    assert waiter_error and not isinstance(waiter_error[0], StoreTimeout)
    with pytest.raises(StoreError, match="lost the connection"):
        c.get("a")


def test_binds_given_address_only():
    s = StoreServer("127.0.0.1", 0, "s")
    assert s._sock.getsockname()[0] == "127.0.0.1"
    s.close()
    s = StoreServer("127.0.0.1", 0, "s", bind_all=True)
    assert s._sock.getsockname()[0] == "0.0.0.0"
    s.close()


def test_port_in_use_is_a_clear_error(server):
    with pytest.raises(StoreError, match=f"{server.port}.*MASTER_PORT"):
        StoreServer("127.0.0.1", server.port, "s")


def test_oversized_value_rejected_client_side(client):
    with pytest.raises(StoreError, match="frame limit"):
        client.set("big", b"\0" * (MAX_FRAME + 1))
    assert client.add("ok", 1) == 1


def test_single_process_connect_store_picks_a_port():
    store = connect_store(resolve_env(environ={}), timeout=5)
    assert store.port > 0
    store.barrier("solo", 1)
    store.close()


def test_empty_secret_works_but_warns(caplog):
    with caplog.at_level("WARNING", logger="nccl_ddp.store"):
        s = StoreServer("127.0.0.1", 0, "")
    assert any("no secret" in r.getMessage() for r in caplog.records)
    c = TCPStore("127.0.0.1", s.port, "", timeout=5)
    assert c.add("a", 1) == 1
    with pytest.raises(AuthError):
        TCPStore("127.0.0.1", s.port, "guess", timeout=5)
    c.close()
    s.close()
