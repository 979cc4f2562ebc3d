"""Private NumPy arrays moved into shared memory where they lie ("adopted"): the whole pages of an
array's buffer are replaced, at the same addresses, by a shared segment holding the same bytes
(mmap MAP_FIXED), so the shm transport's peers read and write that array in place from then on,
as a buffer from `group.zeros`, and a collective on it again copies (almost) nothing.

Only buffers NumPy allocated with glibc's malloc in a mapping of their own (glibc's "mmapped"
chunks: arrays over its mmap threshold, 128 KiB, rising to at most 32 MiB as large arrays are
freed): freeing or moving such a buffer unmaps its whole range, shared pages included, so no later
allocation can land on an adopted page while it is still shared. The bytes before the first and
after the last whole page stay private: `Adopted.edges` says where they are, and the transport
copies them into / out of the segment's own mapping around each collective (a few KiB at most).
The segment is released when the array dies (a weakref callback, which NumPy runs before it frees
the buffer) and, the bytes first copied back into private pages, when the last shm transport of
the process closes (`release_all`). A child forked meanwhile shares an adopted array's pages with
its parent. NCCL_DDP_HOST_ADOPT=0 turns adoption off (private arrays then get mirrors: twins.py).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from nccl_ddp.comm.host import shared
from nccl_ddp.comm.host.segment import Segment

PAGE = mmap.PAGESIZE
MIN_BYTES = 256 << 10  # smaller arrays are not adopted (their edges are a large share of them)
_MAP_FIXED = 0x10  # Linux, every architecture we run on
_IS_MMAPPED = 0x2  # glibc: the chunk's size field flags a chunk in a mapping of its own
_PROT = mmap.PROT_READ | mmap.PROT_WRITE

_LOCK = threading.Lock()
_ADOPTED: dict = {}  # id(owner array) -> Adopted
_TRANSPORTS = [0]  # shm transports open in this process (the last to close releases all)


@functools.lru_cache(maxsize=1)
def _mmap_call() -> Optional[Callable[..., Any]]:
    """libc's mmap through ctypes, on Linux with glibc (whose chunk headers `_own_mapping`
    reads); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    f = libc.mmap
    f.restype = ctypes.c_void_p
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return f  # type: ignore[no-any-return]


def _map_at(addr: int, length: int, flags: int, fd: int, offset: int) -> None:
    f = _mmap_call()
    assert f is not None
    got = f(addr, length, _PROT, flags | _MAP_FIXED, fd, offset)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {addr:#x} ({length} bytes): {os.strerror(err)}")


def _handler_name(a: np.ndarray) -> str:
    try:
        from numpy._core.multiarray import get_handler_name  # NumPy 2
    except ImportError:  # pragma: no cover (NumPy 1.x)
        from numpy.core.multiarray import get_handler_name
    return str(get_handler_name(a))


def owner_of(buf: np.ndarray) -> Optional[np.ndarray]:
    """The array that owns `buf`'s memory (`buf` or a base of it), if an array does."""
    o = buf
    while isinstance(o.base, np.ndarray):
        o = o.base
    return o if o.base is None and o.flags.owndata else None


def _own_mapping(owner: np.ndarray) -> bool:
    """`owner`'s buffer is a glibc chunk in a mapping of its own, as malloc made it for NumPy's
    default allocator (the chunk header: prev_size, then size | flags, right before the data)."""
    if _mmap_call() is None or _handler_name(owner) != "default_allocator":
        return False
    data = owner.ctypes.data
    prev = ctypes.c_size_t.from_address(data - 16).value
    size = ctypes.c_size_t.from_address(data - 8).value
    start, length = data - 16 - prev, prev + (size & ~7)
    return bool(
        size & _IS_MMAPPED
        and start % PAGE == 0
        and length % PAGE == 0
        and data + owner.nbytes <= start + length
    )


class Adopted:
    """One adopted array's segment: `view` (uint8) maps all of its pages at an address of its own
    (the one published to the peers, so `shared.where` finds views of it); `edges`: the byte
    ranges [a, b) of the array (addresses) that stayed private."""

    def __init__(self, owner: np.ndarray) -> None:
        data, n = owner.ctypes.data, owner.nbytes
        self.data, self.nbytes = data, n
        self.base = data // PAGE * PAGE
        self.lo, self.hi = -(-data // PAGE) * PAGE, (data + n) // PAGE * PAGE
        seg = Segment.create(-(-(data + n) // PAGE) * PAGE - self.base)
        try:
            view = seg.array
            ctypes.memmove(view.ctypes.data + self.lo - self.base, self.lo, self.hi - self.lo)
            mapping, fd, start = shared.publish(seg)
        except BaseException:
            seg.close()
            raise
        self.view, self._mapping, self._fd, self._start = view, mapping, fd, start
        try:
            _map_at(self.lo, self.hi - self.lo, mmap.MAP_SHARED, fd, self.lo - self.base)
        except BaseException:
            self.release(restore=False)
            raise
        self.edges = [(data, self.lo), (self.hi, data + n)]

    def twin(self, buf: np.ndarray) -> np.ndarray:
        """`buf` (a view of the adopted array) as it lies in `view`."""
        off = buf.ctypes.data - self.base
        return self.view[off : off + buf.nbytes].view(buf.dtype)

    def release(self, restore: bool) -> None:
        """Unpublish and unmap the segment; `restore`: first put private pages holding the same
        bytes back under the array (it lives on)."""
        if restore:
            keep = np.empty(self.hi - self.lo, np.uint8)
            ctypes.memmove(keep.ctypes.data, self.lo, keep.nbytes)
            _map_at(self.lo, keep.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            ctypes.memmove(self.lo, keep.ctypes.data, keep.nbytes)
        shared.unpublish(self._start, self._fd)
        del self.view
        try:
            self._mapping.close()
        except BufferError:  # a twin view is still alive: the map goes with it
            pass


def adopted(buf: np.ndarray) -> Optional[Adopted]:
    """The adoption of `buf`'s owner (made now if it qualifies and is not adopted yet), or None:
    adoption off, too small, or memory that is not NumPy's own mapping."""
    if buf.nbytes < MIN_BYTES or os.environ.get("NCCL_DDP_HOST_ADOPT", "1") == "0":
        return None
    owner = owner_of(buf)
    if owner is None:
        return None
    key = id(owner)
    with _LOCK:
        a = _ADOPTED.get(key)
        if a is not None and (a.data, a.nbytes) == (owner.ctypes.data, owner.nbytes):
            return a
        if a is not None:  # resized: glibc moved or shrank the buffer; the old pages are its own
            del _ADOPTED[key]
            a.release(restore=False)
        if owner.nbytes < MIN_BYTES or not _own_mapping(owner):
            return None
        try:
            a = _ADOPTED[key] = Adopted(owner)
        except OSError:  # /dev/shm full, or the kernel refused: the caller mirrors it
            return None
    weakref.finalize(owner, _forget, key, a)
    return a


def _forget(key: int, a: Adopted) -> None:
    """The owner died (its buffer is freed right after, unmapping the shared pages with it)."""
    with _LOCK:
        if _ADOPTED.get(key) is a:
            del _ADOPTED[key]
            a.release(restore=False)


def hold() -> None:
    """An shm transport opened (adopted arrays stay shared until the last one closes)."""
    with _LOCK:
        _TRANSPORTS[0] += 1


def let_go() -> None:
    """An shm transport closed; the last one puts every adopted array back in private memory."""
    with _LOCK:
        _TRANSPORTS[0] -= 1
        if _TRANSPORTS[0] > 0:
            return
        for a in _ADOPTED.values():
            a.release(restore=True)
        _ADOPTED.clear()


def count() -> int:
    """Arrays adopted now (for tests and diagnostics)."""
    return len(_ADOPTED)
