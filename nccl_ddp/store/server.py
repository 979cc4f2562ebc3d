"""The store's server: holds the keys, authenticates clients, serves each on its own thread."""
from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time

from nccl_ddp.store.wire import HANDSHAKE_TIMEOUT, MAGIC, _encode, _Malformed, _proof, _recv_frame
from nccl_ddp.errors import StoreError

log = logging.getLogger("nccl_ddp.store")


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
