"""Collectives over TCP between hosts: ring algorithms, pipelined in pieces.

A sender thread streams pieces to the next rank while the group's worker receives pieces from the
previous rank and reduces each as it lands, so the wire and the NumPy reduction overlap:

    sender : send p0 | send p1 | send p2 | ...
    worker :      recv p0 | add p0 | recv p1 | add p1 | ...

all_reduce = reduce-scatter (rank r ends with the full reduction of part r) + all-gather (parts
are copied verbatim), so every rank ends with the same bits.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator, Optional

import numpy as np

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.comm.host.wire import Header, PeerLink
from nccl_ddp.errors import CommTimeout

STAGED, DATA = 1, 3  # message kinds (see wire.KIND_NAMES)


class _Sender:
    """A thread that sends queued messages in order; `drain` waits for the queue to empty."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._items: deque = deque()
        self._busy = False
        self._closed = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, link: PeerLink, header: Header, payload: memoryview) -> None:
        with self._cv:
            if self.error is not None:
                raise self.error
            self._items.append((link, header, payload))
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                link, header, payload = self._items.popleft()
                self._busy = True
            try:
                link.send(header, payload)
            except BaseException as e:
                with self._cv:
                    self.error = e
                    self._items.clear()
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def drain(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: not (self._items or self._busy), timeout):
                raise CommTimeout(f"sending did not finish within {timeout:.1f}s")
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def _part(a: np.ndarray, j: int, n: int) -> np.ndarray:
    """Part j of `a` split into n nearly equal parts (the same split on every rank)."""
    return a[a.size * j // n : a.size * (j + 1) // n]


class RingTransport:
    """Ring collectives over the links to the previous and next group rank."""

    def __init__(self, links: dict, rank: int, size: int, chunk_bytes: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self.chunk = max(4096, chunk_bytes)
        self.next = links[(rank + 1) % size]
        self.prev = links[(rank - 1) % size]
        self.send_seq = self.recv_seq = 0
        self.sender = _Sender(f"nccl_ddp-ring-send-{rank}")

    def _pieces(self, a: np.ndarray) -> Iterator[Any]:
        pe = max(1, self.chunk // a.itemsize)
        for lo in range(0, max(a.size, 1), pe):
            yield a[lo : lo + pe]

    def _send(self, a: np.ndarray, desc: tuple) -> None:
        for p in self._pieces(a):
            self.send_seq += 1
            self.sender.put(self.next, Header(self.send_seq, DATA, *desc), memoryview(p.view(np.uint8)))

    def _recv(
        self, a: np.ndarray, desc: tuple, red: Optional[Reduction] = None, forward: bool = False
    ) -> None:
        """Receive `a` from the previous rank: into it, or reduced into it with `red`; `forward`
        passes each piece on to the next rank as soon as it has arrived."""
        tmp = np.empty(min(a.size, self.chunk // a.itemsize) if red else 0, a.dtype)
        for p in self._pieces(a):
            self.recv_seq += 1
            hdr = Header(self.recv_seq, DATA, *desc)
            self.prev.expect(hdr)
            if red is None:
                self.prev.recv_into(memoryview(p.view(np.uint8)))
            else:
                t = tmp[: p.size]
                self.prev.recv_into(t.view(np.uint8).data)
                red.combine(p, [t], final=False)
            if forward:
                self.send_seq += 1
                self.sender.put(self.next, Header(self.send_seq, DATA, *desc), memoryview(p.view(np.uint8)))

    def _reduce_scatter(self, buf: np.ndarray, red: Reduction, desc: tuple) -> np.ndarray:
        """In place on `buf`; returns part `rank`, fully reduced (AVG divided)."""
        r, n = self.rank, self.size
        for step in range(n - 1):
            self._send(_part(buf, (r - step - 1) % n, n), desc)
            self._recv(_part(buf, (r - step - 2) % n, n), desc, red)
        mine = _part(buf, r, n)
        red.finish(mine)
        return mine

    def _all_gather(self, buf: np.ndarray, desc: tuple) -> None:
        r, n = self.rank, self.size
        for step in range(n - 1):
            self._send(_part(buf, (r - step) % n, n), desc)
            self._recv(_part(buf, (r - step - 1) % n, n), desc)

    def all_reduce(self, buf: np.ndarray, red: Reduction, desc: tuple) -> None:
        red.scale_all(buf)
        self._reduce_scatter(buf, red, desc)
        self._all_gather(buf, desc)
        self.sender.drain(self.timeout)

    def agree(self, desc: tuple) -> None:
        """Send this rank's description of the op to the next rank and check the previous
        rank's: around the ring, every rank then knows that its neighbour runs the same op."""
        self.send_seq += 1
        self.sender.put(self.next, Header(self.send_seq, STAGED, *desc), memoryview(b""))
        self.recv_seq += 1
        self.prev.expect(Header(self.recv_seq, STAGED, *desc))

    def broadcast(self, buf: np.ndarray, root: int, desc: tuple) -> None:
        # data flows only away from the root: without this check, ranks that disagree on the root
        # would all return (the mismatch surfacing at a later collective, under its name)
        self.agree(desc)
        pos = (self.rank - root) % self.size
        if pos == 0:
            self._send(buf, desc)
        else:
            self._recv(buf, desc, forward=pos < self.size - 1)
        self.sender.drain(self.timeout)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, desc: tuple) -> None:
        np.copyto(_part(out, self.rank, self.size), inp)
        self._all_gather(out, desc)
        self.sender.drain(self.timeout)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, red: Reduction, desc: tuple) -> None:
        np.copyto(out, self._reduce_scatter(inp.copy(), red, desc))
        self.sender.drain(self.timeout)

    def barrier(self, desc: tuple) -> None:
        self.all_reduce(np.zeros(1, np.uint8), Reduction(np.uint8, ReduceOp.MAX, self.size, ""), desc)

    def close(self) -> None:
        self.sender.close()


class SelfTransport:
    """A group of one rank: nothing to exchange."""

    def all_reduce(self, buf: Any, red: Reduction, desc: tuple) -> None:
        red.scale_all(buf)
        red.finish(buf)

    def broadcast(self, buf: Any, root: Any, desc: tuple) -> None:
        pass

    def all_gather(self, out: Any, inp: Any, desc: tuple) -> None:
        np.copyto(out, inp)

    def reduce_scatter(self, out: Any, inp: Any, red: Reduction, desc: tuple) -> None:
        np.copyto(out, inp)

    def barrier(self, desc: tuple) -> None:
        pass

    def close(self) -> None:
        pass
