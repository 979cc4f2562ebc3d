"""Authenticated TCP key-value store for rendezvous: NCCL unique ids, barriers, layout checks.

One `StoreServer` (rank 0 in-process, or the launcher) holds the keys; every rank talks to it with a
`TCPStore` client. Wire format: frames of a 4-byte big-endian length and a payload; a payload is a
list of fields, each a 4-byte length and bytes. Requests are [op, args...], replies
[status, values...] with status b"ok", b"timeout" or b"error".

Handshake (the secret never crosses the wire):
    server -> [MAGIC, server_nonce]
    client -> [b"auth", client_nonce, HMAC(secret, b"c" + server_nonce + client_nonce)]
    server -> [b"ok", HMAC(secret, b"s" + server_nonce + client_nonce)]   or [b"auth", reason], close
An empty secret is allowed (a user-run job without NCCL_DDP_SECRET) but the server warns that it is
unauthenticated; nccl-ddp-run always sets one.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Iterable, Optional, Sequence, Union

from .env import DistEnv
from .errors import AuthError, StoreError, StoreTimeout

log = logging.getLogger(__name__)

MAGIC = b"nccl_ddp-store/1"
MAX_FRAME = 64 << 20           # bytes per frame; bigger frames close the connection
HANDSHAKE_TIMEOUT = 10.0       # seconds a new connection has to authenticate
DEFAULT_TIMEOUT = 300.0
_LEN = struct.Struct(">I")

Value = Union[bytes, bytearray, memoryview, str]


class _Malformed(Exception):
    """A peer sent something that is not our protocol; its connection is closed."""


def _encode(fields: Sequence[bytes]) -> bytes:
    payload = b"".join(_LEN.pack(len(f)) + bytes(f) for f in fields)
    if len(payload) > MAX_FRAME:
        raise StoreError(f"store message of {len(payload)} bytes exceeds the {MAX_FRAME >> 20} MiB "
                         f"frame limit; store large data elsewhere and put a reference in the store")
    return _LEN.pack(len(payload)) + payload


def _decode(payload: bytes) -> list[bytes]:
    fields, pos = [], 0
    while pos < len(payload):
        if pos + 4 > len(payload):
            raise _Malformed("truncated field header")
        (n,) = _LEN.unpack_from(payload, pos)
        pos += 4
        if pos + n > len(payload):
            raise _Malformed(f"field of {n} bytes runs past the end of its frame")
        fields.append(payload[pos:pos + n])
        pos += n
    return fields


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> list[bytes]:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise _Malformed(f"frame of {n} bytes exceeds the {MAX_FRAME >> 20} MiB limit")
    return _decode(_recv_exact(sock, n))


def _proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + server_nonce + client_nonce, hashlib.sha256).digest()


def _as_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _ms(seconds: float) -> bytes:
    return str(max(0, int(seconds * 1000))).encode()


class StoreServer:
    """Holds the keys; one thread accepts, one thread serves each authenticated connection.

    Binds `host` (never all interfaces unless `bind_all=True`); `port=0` picks a free port, read it
    back from `.port`. `close()` drops every connection; clients then get StoreError.
    """

    def __init__(self, host: str, port: int, secret: str, *, bind_all: bool = False,
                 backlog: int = 1024):
        self.host = host
        self._secret = secret.encode()
        self._data: dict[str, bytes] = {}
        self._barriers: dict[str, list[int]] = {}    # name -> [arrived, generation, world size]
        self._cond = threading.Condition()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        addr = ("0.0.0.0" if bind_all else host, port)
        try:
            self._sock = socket.create_server(addr, family=_family(addr[0]), backlog=backlog)
        except OSError as e:
            raise StoreError(f"cannot bind the store to {addr[0]}:{port} ({e}); choose another "
                             f"MASTER_PORT, or check MASTER_ADDR is an address of this host") from e
        self._sock.settimeout(0.2)     # so the accept loop notices close()
        self.port: int = self._sock.getsockname()[1]
        if not secret:
            log.warning("store on %s:%d has no secret (NCCL_DDP_SECRET is empty): any process that "
                        "can reach it can read and write keys", addr[0], self.port)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"nccl_ddp-store:{self.port}")
        self._thread.start()

    def close(self, grace: float = 2.0) -> None:
        """Stop serving. Replies already being computed (a barrier that just completed) still go
        out within `grace` seconds; blocked get/wait/barrier calls fail with StoreError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            conns = dict(self._conns)
        self._thread.join(timeout=5)
        self._sock.close()
        for c in conns:                 # wakes threads blocked in recv; sends still work
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for c, t in conns.items():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            _shutdown(c)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._closed:
                    log.exception("store on port %d stopped accepting", self.port)
                return
            t = threading.Thread(target=self._serve, args=(conn, peer), daemon=True)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = t
            t.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn, who):
                return
            while True:
                reply = self._handle(_recv_frame(conn))
                conn.sendall(_encode(reply))
        except _Malformed as e:
            log.warning("store closed the connection from %s: %s", who, e)
        except (ConnectionError, OSError):
            pass           # the client went away or the server is closing
        finally:
            with self._cond:
                self._conns.pop(conn, None)
            _shutdown(conn)

    def _handshake(self, conn: socket.socket, who: str) -> bool:
        conn.settimeout(HANDSHAKE_TIMEOUT)
        nonce = os.urandom(32)
        conn.sendall(_encode([MAGIC, nonce]))
        fields = _recv_frame(conn)
        if len(fields) != 3 or fields[0] != b"auth":
            raise _Malformed("bad handshake")
        client_nonce, proof = fields[1], fields[2]
        if not hmac.compare_digest(proof, _proof(self._secret, b"c", nonce, client_nonce)):
            log.warning("store refused a client from %s: it did not present the job's secret "
                        "(NCCL_DDP_SECRET)", who)
            conn.sendall(_encode([b"auth", b"wrong or missing job secret"]))
            return False
        conn.sendall(_encode([b"ok", _proof(self._secret, b"s", nonce, client_nonce)]))
        conn.settimeout(None)          # authenticated clients may idle between requests
        return True

    def _handle(self, req: list[bytes]) -> list[bytes]:
        if not req:
            raise _Malformed("empty request")
        op, args = req[0].decode("ascii", "replace"), req[1:]
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise _Malformed(f"unknown op {op!r}")
        try:
            with self._cond:
                return handler(*args)
        except (TypeError, ValueError, UnicodeDecodeError) as e:
            raise _Malformed(f"bad arguments to {op!r}: {e}") from e

    def _wait_for(self, predicate, timeout_ms: bytes) -> bool:
        self._cond.wait_for(lambda: self._closed or predicate(), int(timeout_ms) / 1000)
        if predicate():
            return True
        if self._closed:
            raise ConnectionError("store closing")
        return False

    # Each _op_ runs with self._cond held and returns the reply fields.
    def _op_set(self, key: bytes, value: bytes) -> list[bytes]:
        self._data[key.decode()] = value
        self._cond.notify_all()
        return [b"ok"]

    def _op_get(self, key: bytes, timeout_ms: bytes) -> list[bytes]:
        k = key.decode()
        if not self._wait_for(lambda: k in self._data, timeout_ms):
            return [b"timeout"]
        return [b"ok", self._data[k]]

    def _op_wait(self, timeout_ms: bytes, *keys: bytes) -> list[bytes]:
        names = [k.decode() for k in keys]
        if not self._wait_for(lambda: all(k in self._data for k in names), timeout_ms):
            return [b"timeout"] + [k.encode() for k in names if k not in self._data]
        return [b"ok"]

    def _op_add(self, key: bytes, amount: bytes) -> list[bytes]:
        k = key.decode()
        old = self._data.get(k, b"0")
        try:
            new = int(old) + int(amount)
        except ValueError:
            return [b"error", f"key {k!r} holds {old[:40]!r}, not an integer".encode()]
        self._data[k] = str(new).encode()
        self._cond.notify_all()
        return [b"ok", self._data[k]]

    def _op_cas(self, key: bytes, expected: bytes, desired: bytes) -> list[bytes]:
        k = key.decode()
        current = self._data.get(k)
        if (current is None and expected == b"") or current == expected:
            self._data[k] = current = desired
            self._cond.notify_all()
        return [b"ok", b"" if current is None else current]

    def _op_delete(self, key: bytes) -> list[bytes]:
        return [b"ok", b"1" if self._data.pop(key.decode(), None) is not None else b"0"]

    def _op_barrier(self, name: bytes, world: bytes, timeout_ms: bytes) -> list[bytes]:
        n, size = name.decode(), int(world)
        state = self._barriers.setdefault(n, [0, 0, size])
        if state[0] == 0:
            state[2] = size
        elif state[2] != size:
            return [b"error", f"barrier {n!r} entered with world size {size} while {state[0]} "
                              f"rank(s) wait with world size {state[2]}".encode()]
        generation = state[1]
        state[0] += 1
        if state[0] == size:             # last arrival releases everyone; the name is reusable
            state[0], state[1] = 0, generation + 1
            self._cond.notify_all()
            return [b"ok"]
        if not self._wait_for(lambda: state[1] != generation, timeout_ms):
            arrived = state[0]
            state[0] -= 1
            return [b"timeout", str(arrived).encode()]
        return [b"ok"]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class TCPStore:
    """Client of a StoreServer; thread-safe (one request at a time per connection).

    Connects with exponential backoff until `timeout`, then authenticates with `secret`.
    `timeout` is also the default for blocking get/wait/barrier. `server`, if given, is closed with
    this client (rank 0 owns the server it hosts). `rank` only labels error messages.
    """

    def __init__(self, host: str, port: int, secret: str, *, timeout: float = DEFAULT_TIMEOUT,
                 rank: Optional[int] = None, server: Optional[StoreServer] = None):
        self.host, self.port, self.timeout = host, port, timeout
        self._who = f"rank {rank}" if rank is not None else "store client"
        self._server = server
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._sock = self._connect(secret.encode())

    def _connect(self, secret: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay, last = 0.05, None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(
                    f"{self._who}: could not connect to the store at {self.host}:{self.port} "
                    f"within {self.timeout:g}s ({last}); check that MASTER_ADDR/MASTER_PORT point "
                    f"at the node of rank 0 and that rank 0 (or the launcher) started")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=left)
            except OSError as e:
                last = e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
                continue
            try:
                self._authenticate(sock, secret, max(left, 1.0))
            except BaseException:
                sock.close()
                raise
            return sock

    def _authenticate(self, sock: socket.socket, secret: bytes, timeout: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
        where = f"{self.host}:{self.port}"
        try:
            hello = _recv_frame(sock)
            if len(hello) != 2 or hello[0] != MAGIC:
                raise StoreError(f"{self._who}: {where} is not an nccl_ddp store (bad greeting); "
                                 f"check MASTER_ADDR/MASTER_PORT")
            nonce = os.urandom(32)
            sock.sendall(_encode([b"auth", nonce, _proof(secret, b"c", hello[1], nonce)]))
            reply = _recv_frame(sock)
        except (OSError, _Malformed) as e:
            raise StoreError(f"{self._who}: handshake with the store at {where} failed ({e}); "
                             f"check MASTER_ADDR/MASTER_PORT") from e
        if reply[:1] == [b"auth"]:
            raise AuthError(f"{self._who}: the store at {where} refused this client: wrong or "
                            f"missing job secret; set NCCL_DDP_SECRET to the job's secret on "
                            f"every rank (nccl-ddp-run sets it for its workers)")
        expected = _proof(secret, b"s", hello[1], nonce)
        if len(reply) != 2 or reply[0] != b"ok" or not hmac.compare_digest(reply[1], expected):
            raise AuthError(f"{self._who}: the store at {where} could not prove it knows the job "
                            f"secret; another service may be listening on MASTER_PORT")

    def _request(self, fields: Sequence[bytes], wait: float = 0.0) -> list[bytes]:
        """Send one request and read its reply; `wait` is how long the server may block on it."""
        frame = _encode(fields)
        limit = wait + self.timeout
        if not self._lock.acquire(timeout=limit):
            raise StoreTimeout(f"{self._who}: store connection busy for {limit:g}s with another "
                               f"thread's request")
        try:
            if self._sock is None:
                raise StoreError(f"{self._who}: store client is closed (or lost its connection)")
            try:
                self._sock.settimeout(limit)
                self._sock.sendall(frame)
                reply = _recv_frame(self._sock)
            except socket.timeout as e:
                self._drop()
                raise StoreTimeout(f"{self._who}: no reply from the store at {self.host}:"
                                   f"{self.port} within {limit:g}s; is rank 0 alive?") from e
            except (OSError, _Malformed) as e:
                self._drop()
                raise StoreError(f"{self._who}: lost the connection to the store at {self.host}:"
                                 f"{self.port} ({e}); rank 0 or the launcher probably exited") from e
        finally:
            self._lock.release()
        if reply[:1] == [b"error"]:
            raise StoreError(f"{self._who}: store refused {fields[0].decode()}: "
                             f"{reply[1].decode(errors='replace')}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def set(self, key: str, value: Value) -> None:
        self._request([b"set", key.encode(), _as_bytes(value)])

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of `key`, waiting up to `timeout` seconds (None: the store's) for it to be set."""
        t = self.timeout if timeout is None else timeout
        reply = self._request([b"get", key.encode(), _ms(t)], wait=t)
        if reply[0] == b"timeout":
            raise StoreTimeout(f"{self._who}: key {key!r} was not set in the store within {t:g}s; "
                               f"the rank that sets it may have failed or be far behind")
        return reply[1]

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        t = self.timeout if timeout is None else timeout
        reply = self._request([b"wait", _ms(t)] + [k.encode() for k in keys], wait=t)
        if reply[0] == b"timeout":
            missing = [k.decode() for k in reply[1:]]
            raise StoreTimeout(f"{self._who}: keys {missing} were not set in the store within "
                               f"{t:g}s; the ranks that set them may have failed or be far behind")

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add `amount` to the integer at `key` (missing: 0); returns the new value."""
        return int(self._request([b"add", key.encode(), str(int(amount)).encode()])[1])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set `key` to `desired` if it holds `expected` (b"" matches a missing key).

        Returns the value held afterwards (b"" if the key is missing)."""
        return self._request([b"cas", key.encode(), _as_bytes(expected), _as_bytes(desired)])[1]

    def delete(self, key: str) -> bool:
        """Remove `key`; True if it existed."""
        return self._request([b"delete", key.encode()])[1] == b"1"

    def barrier(self, name: str, world_size: int, timeout: Optional[float] = None) -> None:
        """Block until `world_size` callers entered barrier `name`; the name can be reused."""
        t = self.timeout if timeout is None else timeout
        reply = self._request([b"barrier", name.encode(), str(int(world_size)).encode(), _ms(t)],
                              wait=t)
        if reply[0] == b"timeout":
            raise StoreTimeout(f"{self._who}: barrier {name!r} timed out after {t:g}s with "
                               f"{reply[1].decode()} of {world_size} ranks arrived; the others "
                               f"probably failed or are stuck, check their logs")

    def close(self) -> None:
        """Close the connection (and the server, if this client owns it)."""
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> "TCPStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrefixStore:
    """A view of another store whose keys and barrier names live under `prefix/`.

    `close()` does nothing: the underlying store belongs to whoever created it."""

    def __init__(self, store: "TCPStore | PrefixStore", prefix: str):
        self.store, self.prefix = store, prefix

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: Value) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        self.store.wait([self._k(k) for k in keys], timeout)

    def add(self, key: str, amount: int = 1) -> int:
        return self.store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self.store.compare_set(self._k(key), expected, desired)

    def delete(self, key: str) -> bool:
        return self.store.delete(self._k(key))

    def barrier(self, name: str, world_size: int, timeout: Optional[float] = None) -> None:
        self.store.barrier(self._k(name), world_size, timeout)

    def close(self) -> None:
        pass


def connect_store(env: DistEnv, timeout: float = DEFAULT_TIMEOUT) -> TCPStore:
    """Client of the job's store; rank 0 first starts the server unless the launcher hosts it.

    Rank 0's client owns its server: close it last (after a barrier), or the others lose the store.
    """
    server = None
    port = env.master_port
    if env.rank == 0 and not env.store_hosted_externally:
        server = StoreServer(env.master_addr, env.master_port, env.secret)
        port = server.port
    try:
        return TCPStore(env.master_addr, port, env.secret, timeout=timeout, rank=env.rank,
                        server=server)
    except BaseException:
        if server is not None:
            server.close()
        raise
