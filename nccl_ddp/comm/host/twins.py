"""The shared twin of a buffer handed to an shm collective: the memory its peers read (and, for
all_reduce, write) in place, so that every large collective can take the in-place paths.

In order: the buffer itself where it lies in shared memory (`group.zeros`); none the first time a
private buffer is seen (the staged path: making a twin costs more than one staged op, and an array
used once never pays it); its adopted pages
(`adopt.py`: a private NumPy array moved into shared memory where it lies, the bytes at its two
edges copied in and out); else a mirror, a shared buffer of the same size kept per (address,
size) and reused (the whole buffer copied in before the op and out after). Mirrors are scratch:
their content is written before every use, so a buffer freed and another allocated at its
address is still right; one is dropped when its buffer's owner dies (where that can be
watched), by the least recently used first beyond NCCL_DDP_HOST_MIRROR_BYTES (1 GiB), and when
the transport closes.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from nccl_ddp.comm.host import adopt
from nccl_ddp.comm.host.shared import NOT_SHARED, shared_zeros, where
from nccl_ddp.job.env import env_int

MIRROR_BYTES = 1 << 30  # default cap on one transport's mirrors (NCCL_DDP_HOST_MIRROR_BYTES)


@dataclass
class Twin:
    """`view`: the buffer's shared twin; `edges`: its byte ranges [a, b) (offsets into the
    buffer) that only the buffer holds, copied by `load` before and `store` after an op."""

    view: np.ndarray
    edges: list
    path: str  # "shared", "adopted" or "mirror" (for tests and diagnostics)

    def load(self, buf: np.ndarray) -> None:
        src, dst = buf.view(np.uint8), self.view.view(np.uint8)
        for a, b in self.edges:
            np.copyto(dst[a:b], src[a:b])

    def store(self, buf: np.ndarray) -> None:
        src, dst = self.view.view(np.uint8), buf.view(np.uint8)
        for a, b in self.edges:
            np.copyto(dst[a:b], src[a:b])


class Twins:
    """One shm transport's mirrors, and the lookup of any buffer's twin."""

    def __init__(self) -> None:
        self.max_bytes = env_int("NCCL_DDP_HOST_MIRROR_BYTES", MIRROR_BYTES)
        self._lock = threading.Lock()  # (an owner's death drops its mirror on whatever thread)
        self._mirrors: OrderedDict = OrderedDict()  # (address, nbytes) -> uint8 shared buffer
        self._bytes = 0
        self._seen: set = set()  # (id(owner), address, nbytes) of private buffers seen once
        self.last = ""  # the path the last `get` gave: shared, adopted, mirror or staged

    def get(self, buf: np.ndarray) -> Optional[Twin]:
        """`buf`'s twin (1-D, contiguous), or None where none can be had (/dev/shm full, or a
        mirror over the cap)."""
        tw = self._get(buf)
        self.last = "staged" if tw is None else tw.path
        return tw

    def _get(self, buf: np.ndarray) -> Optional[Twin]:
        if where(buf) is not NOT_SHARED:
            return Twin(buf, [], "shared")
        if self._first_time(buf):
            return None
        a = adopt.adopted(buf)
        if a is not None:
            lo, hi = buf.ctypes.data, buf.ctypes.data + buf.nbytes
            edges = [(max(x, lo) - lo, min(y, hi) - lo) for x, y in a.edges if max(x, lo) < min(y, hi)]
            return Twin(a.twin(buf), edges, "adopted")
        m = self._mirror(buf)
        return None if m is None else Twin(m.view(buf.dtype), [(0, buf.nbytes)], "mirror")

    def _first_time(self, buf: np.ndarray) -> bool:
        """True the first time this private buffer (of this owner, at this address and size) is
        seen, and again after its owner died."""
        owner = _outermost(buf)
        key = (id(owner), buf.ctypes.data, buf.nbytes)
        with self._lock:
            if key in self._seen:
                return False
            if len(self._seen) > 4096:  # (owners that cannot be watched: forget them all)
                self._seen.clear()
            self._seen.add(key)
        try:
            weakref.finalize(owner, self._unsee, key).atexit = False
        except TypeError:
            pass
        return True

    def _unsee(self, key: tuple) -> None:
        with self._lock:
            self._seen.discard(key)

    def _mirror(self, buf: np.ndarray) -> Optional[np.ndarray]:
        if buf.nbytes > self.max_bytes:  # (NCCL_DDP_HOST_MIRROR_BYTES=0: no mirrors, staged)
            return None
        key = (buf.ctypes.data, buf.nbytes)
        with self._lock:
            m = self._mirrors.pop(key, None)
            if m is not None:
                self._mirrors[key] = m  # the most recently used now
                return m
        m = shared_zeros(buf.nbytes, np.uint8)
        if m is None:
            return None
        with self._lock:
            self._mirrors[key] = m
            self._bytes += m.nbytes
            while self._bytes > self.max_bytes and len(self._mirrors) > 1:
                self._drop_locked(next(iter(self._mirrors)))
        owner = _outermost(buf)
        try:
            weakref.finalize(owner, self._drop, key, id(m))  # (not m: eviction must free it)
        except TypeError:  # not weakly referable: the size cap alone bounds it
            pass
        return m

    def _drop(self, key: tuple, ident: int) -> None:
        with self._lock:
            if key in self._mirrors and id(self._mirrors[key]) == ident:
                self._drop_locked(key)

    def _drop_locked(self, key: tuple) -> None:
        self._bytes -= self._mirrors.pop(key).nbytes

    def mirrors(self) -> int:
        """Mirrors held now (for tests and diagnostics)."""
        return len(self._mirrors)

    def close(self) -> None:
        with self._lock:
            self._mirrors.clear()
            self._seen.clear()
            self._bytes = 0


def _outermost(buf: np.ndarray) -> Any:
    """The object at the end of `buf`'s base chain: what keeps its memory alive."""
    o: Any = buf
    while isinstance(o, np.ndarray) and o.base is not None:
        o = o.base
    return o
