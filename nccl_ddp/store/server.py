"""The store's server: holds the keys, authenticates clients, serves them all from one thread.

One selector loop accepts, reads, answers and times out every connection, so 2,000 idle ranks
cost 2,000 sockets and no threads. Blocking requests (get of a missing key, wait, barrier) are
parked with a deadline and answered when a later request makes them true, or when it passes.
What the requests do to the keys lives in keys.py; this module is the connections and the loop.

Defences against a local process without the job's secret:
  - before the handshake a frame larger than the handshake needs closes the connection (no
    64 MiB buffers for strangers), and the handshake must finish within HANDSHAKE_DEADLINE;
  - at most MAX_UNAUTHENTICATED connections may be in their handshake: the oldest that sent
    nothing goes first (else the oldest); a client whose handshake is closed retries;
  - running out of file descriptors (EMFILE) pauses accepting briefly, closes the oldest
    unauthenticated connection and logs once; the server keeps accepting afterwards.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

from nccl_ddp.errors import StoreError
from nccl_ddp.store.keys import KeyStore, Parked
from nccl_ddp.store.wire import MAGIC, MAX_FRAME, _decode, _encode, _Malformed, _proof

log = logging.getLogger("nccl_ddp.store")

HANDSHAKE_DEADLINE = 5.0  # seconds a new connection has to authenticate
MAX_UNAUTHENTICATED = 256  # connections in their handshake at once; the oldest is dropped
MAX_HANDSHAKE_FRAME = 512  # bytes; the auth frame is 84
ACCEPT_PAUSE = 0.1  # seconds without accepting after EMFILE/ENFILE
_LEN = struct.Struct(">I")
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Conn:
    """One client connection: buffers, handshake state and at most one parked request."""

    def __init__(self, sock: socket.socket, who: str, nonce: bytes, deadline: float) -> None:
        self.sock, self.who, self.nonce = sock, who, nonce
        self.deadline = deadline  # to finish the handshake by
        self.authenticated = False
        self.received = False  # sent us at least one byte
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.parked: Optional[Parked] = None
        self.closing = False  # close once outbuf is flushed
        self.writing = False  # registered for EVENT_WRITE (outbuf did not fit)


class StoreServer:
    """Holds the keys and serves every connection from one selector thread.

    Binds `host` (never all interfaces unless `bind_all=True`); `port=0` picks a free port, read it
    back from `.port`. `close()` drops every connection; clients then get StoreError.
    """

    def __init__(self, host: str, port: int, secret: str, *, bind_all: bool = False, backlog: int = 1024):
        self.host = host
        self._secret = secret.encode()
        self._keys = KeyStore()
        self._conns: dict[socket.socket, _Conn] = {}
        self._pending: OrderedDict[socket.socket, _Conn] = OrderedDict()  # unauthenticated
        self._closed = False
        self._accept_paused_until: Optional[float] = None
        self._resource_logged = False
        self._parked: dict[socket.socket, _Conn] = {}  # connections with a parked request
        self._rbuf = bytearray(256 << 10)
        self._rview = memoryview(self._rbuf)
        addr = ("0.0.0.0" if bind_all else host, port)
        try:
            self._sock = socket.create_server(addr, family=_family(addr[0]), backlog=backlog)
        except OSError as e:
            raise StoreError(
                f"cannot bind the store to {addr[0]}:{port} ({e}); choose another "
                f"MASTER_PORT, or check MASTER_ADDR is an address of this host"
            ) from e
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        if not secret:
            log.warning(
                "store on %s:%d has no secret (NCCL_DDP_SECRET is empty): any process that "
                "can reach it can read and write keys; launch with nccl-ddp-run (it makes one), "
                "set NCCL_DDP_SECRET to the same random value on every rank, or call "
                "torch.distributed.init_process_group before nccl_ddp's (rank 0 then sends one)",
                addr[0],
                self.port,
            )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._grace = 2.0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"nccl_ddp-store:{self.port}")
        self._thread.start()

    def close(self, grace: float = 2.0) -> None:
        """Stop serving. Replies already computed still go out within `grace` seconds; parked
        get/wait/barrier requests fail (their connection closes: StoreError on the client)."""
        if self._closed:
            return
        self._grace = grace
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=grace + 5)
        if self._thread.is_alive():
            log.warning("store on port %d: serving thread did not stop", self.port)
            return
        self._sel.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has_prefix(self, prefix: str) -> bool:
        """Whether any key starts with `prefix` (the launcher asks once its workers exited)."""
        return self._keys.has_prefix(prefix)

    @property
    def connections(self) -> int:
        """Open client connections (authenticated or not)."""
        return len(self._conns)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._on_event(key.data, mask)
                self._settle()
                self._expire(time.monotonic())
                self._settle()
        except Exception:  # a bug here must not leave ranks hanging on a silent store
            log.exception("store on port %d stopped serving", self.port)
        finally:
            self._shutdown_all()

    def _next_timeout(self) -> float:
        now, t = time.monotonic(), 1.0
        if self._accept_paused_until is not None:
            t = min(t, self._accept_paused_until - now)
        if self._pending:
            t = min(t, next(iter(self._pending.values())).deadline - now)
        for c in self._parked.values():
            if c.parked is not None:
                t = min(t, c.parked.deadline - now)
        return max(0.0, t)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        for _ in range(64):  # a burst per wakeup, then serve the others
            try:
                sock, peer = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in _RESOURCE_ERRNOS:
                    raise
                self._out_of_resources(e)
                return
            self._admit(sock, peer)

    def _out_of_resources(self, e: OSError) -> None:
        if not self._resource_logged:
            self._resource_logged = True
            log.warning(
                "store on port %d cannot accept (%s; %d connections open, %d not "
                "authenticated); dropping the oldest unauthenticated ones and retrying "
                "(logged once)",
                self.port,
                e,
                len(self._conns),
                len(self._pending),
            )
        if self._pending:
            self._drop(self._evictee())
        self._sel.unregister(self._sock)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        if len(self._pending) >= MAX_UNAUTHENTICATED:
            self._drop(self._evictee())
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        nonce = os.urandom(32)
        c = _Conn(sock, f"{peer[0]}:{peer[1]}", nonce, time.monotonic() + HANDSHAKE_DEADLINE)
        self._conns[sock] = c
        self._pending[sock] = c
        self._sel.register(sock, selectors.EVENT_READ, c)
        self._send(c, [MAGIC, nonce])

    def _evictee(self) -> _Conn:
        """The unauthenticated connection to close for room: the oldest that has sent nothing
        (a client sends its auth frame as soon as it reads the greeting), else the oldest."""
        oldest = next(iter(self._pending.values()))
        return next((c for c in self._pending.values() if not c.received), oldest)

    def _expire(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        while self._pending:
            c = next(iter(self._pending.values()))
            if c.deadline > now:
                break
            log.warning(
                "store closed the connection from %s: no handshake within %gs", c.who, HANDSHAKE_DEADLINE
            )
            self._drop(c)
        for c in list(self._parked.values()):
            if c.sock in self._parked and c.parked is not None and c.parked.deadline <= now:
                p = self._unpark(c)
                self._send(c, p.reply() if p.ready() else p.expire())
                self._process(c)

    def _settle(self) -> None:
        """Answer the parked requests that changes made ready (answering may change more)."""
        while self._keys.dirty:
            self._keys.dirty = False
            for c in list(self._parked.values()):
                if c.sock in self._parked and c.parked is not None and c.parked.ready():
                    self._send(c, self._unpark(c).reply())
                    self._process(c)

    def _unpark(self, c: _Conn) -> Parked:
        p, c.parked = c.parked, None
        del self._parked[c.sock]
        if p is None:
            raise RuntimeError("store: unparked a connection without a parked request")
        return p

    # -- reading and writing -------------------------------------------------------------------

    def _on_event(self, c: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(c)
        if mask & selectors.EVENT_READ and c.sock in self._conns:
            try:
                n = c.sock.recv_into(self._rbuf)  # no 1 MiB allocation per request
            except BlockingIOError:
                return
            except OSError:
                n = 0
            if not n:
                self._drop(c)
                return
            c.inbuf += self._rview[:n]
            c.received = True
            self._process(c)

    def _process(self, c: _Conn) -> None:
        """Handle the complete frames buffered on `c`, one at a time (a parked request waits)."""
        try:
            while c.parked is None and not c.closing and len(c.inbuf) >= 4:
                (n,) = _LEN.unpack_from(c.inbuf)
                limit = MAX_FRAME if c.authenticated else MAX_HANDSHAKE_FRAME
                if n > limit:
                    raise _Malformed(
                        f"frame of {n} bytes exceeds the {limit}-byte limit"
                        + ("" if c.authenticated else " before authentication")
                    )
                if len(c.inbuf) < 4 + n:
                    return
                fields = _decode(bytes(c.inbuf[4 : 4 + n]))
                del c.inbuf[: 4 + n]
                if c.authenticated:
                    self._request(c, fields)
                else:
                    self._handshake(c, fields)
        except _Malformed as e:
            log.warning("store closed the connection from %s: %s", c.who, e)
            self._drop(c)

    def _send(self, c: _Conn, fields: list) -> None:
        c.outbuf += _encode(fields)
        self._flush(c)

    def _flush(self, c: _Conn) -> None:
        if c.sock not in self._conns:
            return
        try:
            while c.outbuf:
                k = c.sock.send(c.outbuf)
                del c.outbuf[:k]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(c)
            return
        if c.closing and not c.outbuf:
            self._drop(c)
        elif c.writing != bool(c.outbuf):
            c.writing = bool(c.outbuf)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.writing else 0)
            self._sel.modify(c.sock, events, c)

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock, None) is None:
            return
        self._pending.pop(c.sock, None)
        self._parked.pop(c.sock, None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        _shutdown(c.sock)

    def _shutdown_all(self) -> None:
        """On close: parked requests are abandoned; computed replies get `grace` to go out."""
        self._parked.clear()
        for c in list(self._conns.values()):
            c.parked = None
            c.closing = True
            if c.outbuf:
                c.sock.setblocking(True)
        deadline = time.monotonic() + self._grace
        for c in list(self._conns.values()):
            if c.outbuf:
                try:
                    c.sock.settimeout(max(0.01, deadline - time.monotonic()))
                    c.sock.sendall(c.outbuf)
                except OSError:
                    pass
            self._drop(c)

    # -- protocol ------------------------------------------------------------------------------

    def _handshake(self, c: _Conn, fields: list) -> None:
        if len(fields) != 3 or fields[0] != b"auth":
            raise _Malformed("bad handshake")
        client_nonce, proof = fields[1], fields[2]
        if not hmac.compare_digest(proof, _proof(self._secret, b"c", c.nonce, client_nonce)):
            log.warning(
                "store refused a client from %s: it did not present the job's secret (NCCL_DDP_SECRET)", c.who
            )
            c.closing = True
            self._pending.pop(c.sock, None)
            self._send(c, [b"auth", b"wrong or missing job secret"])
            return
        c.authenticated = True
        self._pending.pop(c.sock, None)
        self._send(c, [b"ok", _proof(self._secret, b"s", c.nonce, client_nonce)])

    def _request(self, c: _Conn, req: list) -> None:
        if not req:
            raise _Malformed("empty request")
        op, args = req[0].decode("ascii", "replace"), req[1:]
        handler = getattr(self._keys, f"op_{op}", None)
        if handler is None:
            raise _Malformed(f"unknown op {op!r}")
        try:
            reply = handler(*args)
        except (TypeError, ValueError, UnicodeDecodeError) as e:
            raise _Malformed(f"bad arguments to {op!r}: {e}") from e
        if isinstance(reply, Parked):
            c.parked = reply
            self._parked[c.sock] = c
        else:
            self._send(c, reply)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
