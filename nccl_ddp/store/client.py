"""Authenticated TCP key-value store for rendezvous: NCCL unique ids, barriers, layout checks.

One `StoreServer` (rank 0 in-process, or the launcher) holds the keys; every rank talks to it with a
`TCPStore` client; `PrefixStore` gives a group its own key namespace. Frames are length-prefixed
(see `nccl_ddp.store.wire`), at most 64 MiB; a malformed frame closes only the connection that sent it.

Handshake (the secret never crosses the wire):
    server -> [MAGIC, server_nonce]
    client -> [b"auth", client_nonce, HMAC(secret, b"c" + server_nonce + client_nonce)]
    server -> [b"ok", HMAC(secret, b"s" + server_nonce + client_nonce)]   or [b"auth", reason], close
An empty secret is allowed (a user-run job without NCCL_DDP_SECRET) but the server warns that it is
unauthenticated; nccl-ddp-run always sets one.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Iterable, Optional, Sequence

from nccl_ddp.errors import AuthError, StoreError, StoreTimeout
from nccl_ddp.job.env import DEFAULT_TIMEOUT, DistEnv
from nccl_ddp.store.server import StoreServer
from nccl_ddp.store.wire import (
    HANDSHAKE_TIMEOUT,
    MAGIC,
    MAX_FRAME,
    Value,
    _as_bytes,
    _encode,
    _Malformed,
    _ms,
    _proof,
    _recv_frame,
)

__all__ = ["StoreServer", "TCPStore", "PrefixStore", "connect_store", "MAX_FRAME"]

NOTICE_EVERY = 30.0  # seconds between the warnings of a client still waiting to connect

log = logging.getLogger("nccl_ddp.store")


class TCPStore:
    """Client of a StoreServer; thread-safe (one request at a time per connection).

    Connects with exponential backoff until `timeout`, then authenticates with `secret`.
    `timeout` is also the default for blocking get/wait/barrier. `server`, if given, is closed with
    this client (rank 0 owns the server it hosts). `rank` only labels error messages.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        rank: Optional[int] = None,
        server: Optional[StoreServer] = None,
        waiting: str = "",
    ):
        self.host, self.port, self.timeout = host, port, timeout
        self._waiting = waiting  # who should host the store, for the notices while connecting
        self._who = f"rank {rank}" if rank is not None else "store client"
        self._server = server
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = self._connect(secret.encode())

    def _connect(self, secret: bytes) -> socket.socket:
        """Connect and authenticate, retrying with backoff until `timeout`: a refused connection
        (the server is not up yet) and a handshake the server closed (it evicts unauthenticated
        connections when strangers flood it) are retried; a wrong secret or a service that is
        not a store is final."""
        start = time.monotonic()
        deadline, notice = start + self.timeout, start + NOTICE_EVERY
        delay: float = 0.05
        last: Optional[BaseException] = None
        while True:
            if time.monotonic() >= notice:  # a launcher environment that counts a rank not started
                log.warning(
                    "%s: still waiting to connect to the store at %s:%d after %.0fs of the %gs timeout "
                    "(%s)%s",
                    self._who,
                    self.host,
                    self.port,
                    time.monotonic() - start,
                    self.timeout,
                    last,
                    f"; {self._waiting}" if self._waiting else "",
                )
                notice += NOTICE_EVERY
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(
                    f"{self._who}: could not connect to the store at {self.host}:{self.port} "
                    f"within {self.timeout:g}s ({last}); check that MASTER_ADDR/MASTER_PORT point "
                    f"at the node of rank 0 and that rank 0 (or the launcher) started"
                    + (f" ({self._waiting})" if self._waiting else "")
                )
            try:
                sock = socket.create_connection((self.host, self.port), timeout=left)
            except OSError as e:
                last = e
            else:
                try:
                    self._authenticate(sock, secret, max(left, 1.0))
                    return sock
                except _HandshakeLost as e:
                    sock.close()
                    last = e.__cause__
                except BaseException:
                    sock.close()
                    raise
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def _authenticate(self, sock: socket.socket, secret: bytes, timeout: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
        where = f"{self.host}:{self.port}"
        try:
            hello = _recv_frame(sock)
        except OSError as e:
            raise _HandshakeLost() from e
        except _Malformed:
            hello = []
        if len(hello) != 2 or hello[0] != MAGIC:
            raise StoreError(
                f"{self._who}: {where} is not an nccl_ddp store (bad greeting); check MASTER_ADDR/MASTER_PORT"
            )
        nonce = os.urandom(32)
        try:
            sock.sendall(_encode([b"auth", nonce, _proof(secret, b"c", hello[1], nonce)]))
            reply = _recv_frame(sock)
        except (OSError, _Malformed) as e:
            raise _HandshakeLost() from e
        if reply[:1] == [b"auth"]:
            raise AuthError(
                f"{self._who}: the store at {where} refused this client: wrong or "
                f"missing job secret; set NCCL_DDP_SECRET to the job's secret on "
                f"every rank (nccl-ddp-run sets it for its workers)"
            )
        expected = _proof(secret, b"s", hello[1], nonce)
        if len(reply) != 2 or reply[0] != b"ok" or not hmac.compare_digest(reply[1], expected):
            raise AuthError(
                f"{self._who}: the store at {where} could not prove it knows the job "
                f"secret; another service may be listening on MASTER_PORT"
            )

    def _request(self, fields: Sequence[bytes], wait: float = 0.0) -> list[bytes]:
        """Send one request and read its reply; `wait` is how long the server may block on it."""
        frame = _encode(fields)
        limit = wait + self.timeout
        if not self._lock.acquire(timeout=limit):
            raise StoreTimeout(
                f"{self._who}: store connection busy for {limit:g}s with another thread's request"
            )
        try:
            if self._sock is None:
                raise StoreError(f"{self._who}: store client is closed (or lost its connection)")
            try:
                self._sock.settimeout(limit)
                self._sock.sendall(frame)
                reply = _recv_frame(self._sock)
            except TimeoutError as e:
                self._drop()
                raise StoreTimeout(
                    f"{self._who}: no reply from the store at {self.host}:"
                    f"{self.port} within {limit:g}s; is rank 0 alive?"
                ) from e
            except (OSError, _Malformed) as e:
                self._drop()
                raise StoreError(
                    f"{self._who}: lost the connection to the store at {self.host}:"
                    f"{self.port} ({e}); rank 0 or the launcher probably exited"
                ) from e
        finally:
            self._lock.release()
        if reply[:1] == [b"error"]:
            raise StoreError(
                f"{self._who}: store refused {fields[0].decode()}: {reply[1].decode(errors='replace')}"
            )
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
            raise StoreTimeout(
                f"{self._who}: key {key!r} was not set in the store within {t:g}s; "
                f"the rank that sets it may have failed or be far behind"
            )
        return reply[1]

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        t = self.timeout if timeout is None else timeout
        reply = self._request([b"wait", _ms(t)] + [k.encode() for k in keys], wait=t)
        if reply[0] == b"timeout":
            missing = [k.decode() for k in reply[1:]]
            raise StoreTimeout(
                f"{self._who}: keys {missing} were not set in the store within "
                f"{t:g}s; the ranks that set them may have failed or be far behind"
            )

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
        reply = self._request([b"barrier", name.encode(), str(int(world_size)).encode(), _ms(t)], wait=t)
        if reply[0] == b"timeout":
            raise StoreTimeout(
                f"{self._who}: barrier {name!r} timed out after {t:g}s with "
                f"{reply[1].decode()} of {world_size} ranks arrived; the others "
                f"probably failed or are stuck, check their logs"
            )

    def close(self) -> None:
        """Close the connection (and the server, if this client owns it)."""
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HandshakeLost(Exception):
    """The connection broke or timed out during the handshake (the server may have evicted it);
    `__cause__` says how. The client retries."""


class PrefixStore:
    """A view of another store whose keys and barrier names live under `prefix/`.

    `close()` does nothing: the underlying store belongs to whoever created it."""

    def __init__(self, store: TCPStore | PrefixStore, prefix: str):
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
    A job of one without NCCL_DDP_SECRET gets a random secret: nobody else needs to connect.
    """
    secret = env.secret
    if not secret and env.world_size == 1 and not env.store_hosted_externally:
        secret = secrets.token_hex(16)
    server = None
    port = env.store_port
    if env.rank == 0 and not env.store_hosted_externally:
        server = StoreServer(env.master_addr, env.store_port, secret)
        port = server.port
    try:
        hosted = "the launcher hosts it" if env.store_hosted_externally else "rank 0 hosts it"
        waiting = f"{hosted}; world size {env.world_size} from {env.world_from}" if env.world_from else hosted
        return TCPStore(
            env.master_addr, port, secret, timeout=timeout, rank=env.rank, server=server, waiting=waiting
        )
    except BaseException:
        if server is not None:
            server.close()
        raise
