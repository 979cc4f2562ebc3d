"""Wire format and handshake proofs of the store (shared by client and server).

Frames: a 4-byte big-endian length and a payload; a payload is a list of fields, each a 4-byte
length and bytes. Requests are [op, args...], replies [status, values...] with status b"ok",
b"timeout" or b"error".
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Sequence, Union

from nccl_ddp.errors import StoreError

MAGIC = b"nccl_ddp-store/1"
MAX_FRAME = 64 << 20  # bytes per frame; bigger frames close the connection
HANDSHAKE_TIMEOUT = 10.0  # seconds a client waits for each handshake reply
_LEN = struct.Struct(">I")

Value = Union[bytes, bytearray, memoryview, str]


class _Malformed(Exception):
    """A peer sent something that is not our protocol; its connection is closed."""


def _encode(fields: Sequence[bytes]) -> bytes:
    payload = b"".join(_LEN.pack(len(f)) + bytes(f) for f in fields)
    if len(payload) > MAX_FRAME:
        raise StoreError(
            f"store message of {len(payload)} bytes exceeds the {MAX_FRAME >> 20} MiB "
            f"frame limit; store large data elsewhere and put a reference in the store"
        )
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
        fields.append(payload[pos : pos + n])
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
