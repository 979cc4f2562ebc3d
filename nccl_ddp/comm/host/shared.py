"""Buffers that the shm transport's peers read in place: each in a segment of its own
(`segment.Segment`), found again by address when a collective is handed a view of it."""

from __future__ import annotations

import itertools
import logging
import os
import struct
import weakref
from typing import Any, Optional

import numpy as np

from nccl_ddp.comm.host.segment import Segment
from nccl_ddp.errors import CommError

log = logging.getLogger(__name__)

_SERIALS = itertools.count(1)
_SHARED: dict = {}  # start address -> (end address, key, segment bytes): this process's live ones
WHERE = struct.Struct("<QQd96s")  # offset in the segment, its bytes (0: not shared), prescale, key
NOT_SHARED = WHERE.pack(0, 0, 1.0, b"")
_SAID_NO_ROOM = False  # the warning that /dev/shm had no room for a shared buffer was logged


def shared_zeros(n: int, dtype: Any) -> Optional[np.ndarray]:
    """`n` zeros of `dtype` in a segment of their own, which the shm transport's peers map and read
    in place (an all-reduce on it then copies nothing through staging slots); None when /dev/shm
    cannot hold it (the caller allocates privately). The array keeps the mapping; its descriptor,
    through which peers map it, stays open until the mapping is freed."""
    dt = np.dtype(dtype)
    nbytes = max(1, n * dt.itemsize)
    try:
        seg = Segment.create(nbytes)
    except (OSError, CommError) as e:
        global _SAID_NO_ROOM
        level = logging.DEBUG if _SAID_NO_ROOM else logging.WARNING  # once a process, not per bucket
        _SAID_NO_ROOM = True
        log.log(level, "no shared bucket memory (%s); using private memory and staging copies", e)
        return None
    out = seg.array[: n * dt.itemsize].view(dt)
    mapping, fd, start = publish(seg)
    weakref.finalize(mapping, unpublish, start, fd)  # the descriptor closes with the mapping
    return out


def publish(seg: Segment) -> tuple:
    """Make the peers able to map `seg` (`where` finds every view of it) until `unpublish`:
    returns (its mapping, its descriptor, the mapping's start address), this process's to keep."""
    start = seg.array.ctypes.data
    key = f"{seg.handle}:{next(_SERIALS)}"  # the serial: a reused descriptor or inode is a new key
    _SHARED[start] = (start + seg.array.nbytes, key, seg.array.nbytes)
    mapping, fd = seg.keep_open()
    return mapping, fd, start


def unpublish(start: int, fd: int) -> None:
    """`where` no longer finds the segment published at `start`; its descriptor closes."""
    _SHARED.pop(start, None)
    os.close(fd)


def where(buf: np.ndarray, prescale: float = 1.0) -> bytes:
    """Which shared segment of this process `buf` lies in, and the reduction's prescale, packed
    for the peers (`WHERE`); `NOT_SHARED` itself when it lies in none."""
    lo = buf.ctypes.data
    hi = lo + buf.nbytes
    for start, (end, key, nbytes) in tuple(_SHARED.items()):  # (a finalizer may pop one meanwhile)
        if start <= lo and hi <= end:
            return WHERE.pack(lo - start, nbytes, prescale, key.encode())
    return NOT_SHARED
