"""The store's key space: the keys, the barriers, and the operations clients send on them.

Each `op_<name>` takes a request's argument fields and returns the reply fields, or a `Parked`
request when the answer must wait (a get of a missing key, wait, barrier): the server
(server.py) holds it with its deadline and answers it once `ready()` or the deadline passes.
`dirty` says the keys changed since the server last looked (parked requests may be ready).
"""

from __future__ import annotations

import time
from typing import Callable


class Parked:
    """A blocking request: `ready()` says when `reply()` can answer; `expire()` answers at the
    deadline."""

    def __init__(
        self,
        ready: Callable[[], bool],
        reply: Callable[[], list],
        expire: Callable[[], list],
        deadline: float,
    ) -> None:
        self.ready, self.reply, self.expire, self.deadline = ready, reply, expire, deadline


class KeyStore:
    """Keys (str -> bytes) and named barriers; no sockets, no threads (the server's one thread
    calls it)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.barriers: dict[str, list[int]] = {}  # name -> [arrived, generation, world size]
        self.dirty = False  # keys changed: parked requests may be ready

    def has_prefix(self, prefix: str) -> bool:
        """Whether any key starts with `prefix` (copying the keys is one C call under the GIL,
        safe beside the serving thread)."""
        return any(k.startswith(prefix) for k in list(self.data))

    @staticmethod
    def _park(
        ready: Callable[[], bool],
        reply: Callable[[], list],
        expire: Callable[[], list],
        timeout_ms: bytes,
    ) -> list | Parked:
        if ready():
            return reply()
        return Parked(ready, reply, expire, time.monotonic() + int(timeout_ms) / 1000)

    def op_set(self, key: bytes, value: bytes) -> list[bytes]:
        self.data[key.decode()] = value
        self.dirty = True
        return [b"ok"]

    def op_get(self, key: bytes, timeout_ms: bytes) -> list | Parked:
        k = key.decode()
        return self._park(
            lambda: k in self.data, lambda: [b"ok", self.data[k]], lambda: [b"timeout"], timeout_ms
        )

    def op_wait(self, timeout_ms: bytes, *keys: bytes) -> list | Parked:
        names = [k.decode() for k in keys]
        return self._park(
            lambda: all(k in self.data for k in names),
            lambda: [b"ok"],
            lambda: [b"timeout"] + [k.encode() for k in names if k not in self.data],
            timeout_ms,
        )

    def op_add(self, key: bytes, amount: bytes) -> list[bytes]:
        k = key.decode()
        old = self.data.get(k, b"0")
        try:
            new = int(old) + int(amount)
        except ValueError:
            return [b"error", f"key {k!r} holds {old[:40]!r}, not an integer".encode()]
        self.data[k] = str(new).encode()
        self.dirty = True
        return [b"ok", self.data[k]]

    def op_cas(self, key: bytes, expected: bytes, desired: bytes) -> list[bytes]:
        k = key.decode()
        current = self.data.get(k)
        if (current is None and expected == b"") or current == expected:
            self.data[k] = current = desired
            self.dirty = True
        return [b"ok", b"" if current is None else current]

    def op_delete(self, key: bytes) -> list[bytes]:
        return [b"ok", b"1" if self.data.pop(key.decode(), None) is not None else b"0"]

    def op_barrier(self, name: bytes, world: bytes, timeout_ms: bytes) -> list | Parked:
        n, size = name.decode(), int(world)
        int(timeout_ms)  # a malformed timeout fails before the state changes
        state = self.barriers.setdefault(n, [0, 0, size])
        if state[0] == 0:
            state[2] = size
        elif state[2] != size:
            return [
                b"error",
                f"barrier {n!r} entered with world size {size} while {state[0]} "
                f"rank(s) wait with world size {state[2]}".encode(),
            ]
        generation = state[1]
        state[0] += 1
        if state[0] == size:  # last arrival releases everyone; the name is reusable
            state[0], state[1] = 0, generation + 1
            self.dirty = True
            return [b"ok"]

        def expire() -> list[bytes]:
            arrived = state[0]
            state[0] -= 1
            return [b"timeout", str(arrived).encode()]

        return self._park(lambda: state[1] != generation, lambda: [b"ok"], expire, timeout_ms)
