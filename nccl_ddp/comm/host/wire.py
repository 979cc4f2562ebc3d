"""Sockets between the ranks of a host group: links and framed messages (the rendezvous that makes
the links is rendezvous.py).

Every message starts with a `Header` naming the collective it belongs to, so ranks that run
different collectives (or the same one with different sizes) fail at once with a
`RankMismatchError` instead of exchanging garbage.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any, Optional

from nccl_ddp.comm.host.reduce import DTYPE_NAMES
from nccl_ddp.errors import CommError, CommTimeout, RankMismatchError

log = logging.getLogger(__name__)

OP_NAMES = ("", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "setup")
ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, BARRIER, SETUP = range(1, 7)
KIND_NAMES = ("", "staged", "reduced", "data", "abort")
ABORT = 4
_HEADER = struct.Struct("<QBBBBIQ")  # seq, kind, op, dtype code, reduce op code, root, count


@dataclass(frozen=True)
class Header:
    """What a message is: which chunk step (`seq`), what kind of signal, and the collective's
    description (op, dtype, reduce op, root, element count), identical on every rank."""

    seq: int
    kind: int
    op: int
    dtype: int = 0
    redop: int = 0
    root: int = 0
    count: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(self.seq, self.kind, self.op, self.dtype, self.redop, self.root, self.count)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        return cls(*_HEADER.unpack(raw))

    def describe(self) -> str:
        op = OP_NAMES[self.op] if self.op < len(OP_NAMES) else f"op{self.op}"
        dt = DTYPE_NAMES[self.dtype] if self.dtype < len(DTYPE_NAMES) else f"dtype{self.dtype}"
        return f"{op}({dt} x {self.count}, root/op {self.root}/{self.redop}, step {self.seq})"


class PeerLink:
    """A connected TCP socket to one peer; every blocking call is bounded by `timeout`. `sent`:
    bytes sent on it so far (headers included); `cross_node`: the peer runs on another node
    (the backend sets it, and `throttle`, a `throttle.TokenBucket` that paces what it sends)."""

    def __init__(self, sock: socket.socket, peer: int, timeout: float) -> None:
        self.sock = sock
        self.peer = peer  # the peer's global rank, for messages
        self.timeout = timeout
        self.sent = 0
        self.cross_node = False
        self.throttle: Optional[Any] = None
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, header: Header, payload: Optional[memoryview] = None) -> None:
        n = _HEADER.size + (payload.nbytes if payload is not None else 0)
        if self.throttle is not None:
            self.throttle.take(n)
        self.sent += n
        try:
            if payload is not None and payload.nbytes:
                self.sock.sendall(header.pack())
                self.sock.sendall(payload)
            else:
                self.sock.sendall(header.pack())
        except TimeoutError as e:
            raise CommTimeout(
                f"peer rank {self.peer} did not accept data for {self.timeout:.1f}s (is it stuck or dead?)"
            ) from e
        except OSError as e:
            reason = self._abort_waiting()
            if reason is not None:  # it gave up and closed before reading what we sent
                raise CommError(f"peer rank {self.peer} gave up: {reason}") from e
            raise CommError(
                f"lost the connection to peer rank {self.peer} ({e}); did it die? check its log"
            ) from e

    def _abort_waiting(self) -> Optional[str]:
        """The reason of an abort message the peer sent next, if it is already here."""
        try:
            if not _readable(self.sock):
                return None
            raw = self.sock.recv(_HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(raw) < _HEADER.size or Header.unpack(raw).kind != ABORT:
                return None
            n = _HEADER.size + min(Header.unpack(raw).count, 4096)
            raw = self.sock.recv(n, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return raw[_HEADER.size :].decode(errors="replace") if len(raw) == n else None
        except (OSError, ValueError):
            return None

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, view.nbytes
        try:
            while got < n:
                k = self.sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise CommError(
                        f"peer rank {self.peer} closed the connection (did it die or fail? check its log)"
                    )
                got += k
        except TimeoutError as e:
            raise CommTimeout(
                f"peer rank {self.peer} sent nothing for {self.timeout:.1f}s "
                f"(is it stuck, dead, or running a different collective?)"
            ) from e
        except CommError:
            raise
        except OSError as e:
            raise CommError(
                f"lost the connection to peer rank {self.peer} ({e}); did it die? check its log"
            ) from e

    def expect(self, want: Header) -> None:
        """Receive the next header and check it is `want`."""
        raw = bytearray(_HEADER.size)
        self.recv_into(memoryview(raw))
        got = Header.unpack(bytes(raw))
        if got.kind == ABORT:
            reason = bytearray(min(got.count, 4096))
            self.recv_into(memoryview(reason))
            raise CommError(f"peer rank {self.peer} gave up: {reason.decode(errors='replace')}")
        if got != want:
            raise RankMismatchError(
                f"peer rank {self.peer} sent {KIND_NAMES[got.kind] if got.kind < 5 else got.kind} "
                f"for {got.describe()} while this rank expected {KIND_NAMES[want.kind]} for "
                f"{want.describe()}; every rank must call the same collectives, in the same order, "
                f"with the same sizes and dtypes"
            )

    def closed_by_peer(self) -> bool:
        """True if the peer closed its end (it exited or shut the group down); never blocks.

        Polled, not peeked with MSG_DONTWAIT: on a socket with a timeout Python first waits up to
        that timeout for data, so a live, quiet peer cost a whole timeout and then looked lost."""
        try:
            if not _readable(self.sock):
                return False  # nothing to read, no hang-up: the peer is there
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError, TimeoutError):
            return False
        except (OSError, ValueError):  # reset, or our own socket already closed
            return True

    def abort(self, reason: str) -> None:
        """Tell the peer why this rank gives up, then end our direction of the stream: the peer's
        next read fails with the reason instead of waiting for its timeout."""
        text = reason.encode()[:4096]
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(Header(0, ABORT, 0, count=len(text)).pack() + text)
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _readable(sock: socket.socket) -> bool:
    """Data or a hang-up waits on `sock` (never blocks, whatever the socket's timeout)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
