"""Private NumPy arrays moved into shared memory where they lie ("adopted"): the whole pages of an
array's buffer are replaced, at the same addresses, by a shared segment holding the same bytes
(mmap MAP_FIXED), so the shm transport's peers read and write that array in place from then on,
as a buffer from `group.zeros`, and a collective on it again copies (almost) nothing.

Only buffers NumPy's default allocator made (malloc): only the pages wholly inside the buffer are
replaced, and no other object has bytes there. The bytes before the first and after the last whole
page stay private: `Adopted.edges` says where they are, and the transport copies them into / out
of the segment's own mapping around each collective (a few KiB at most). The segment is released
when the array dies (a weakref callback, which NumPy runs before it frees the buffer) and, the
bytes first copied back into private pages, when the last shm transport of the process closes
(`let_go`). A buffer in a mapping of its own (glibc's "mmapped" chunks: over its mmap threshold,
128 KiB rising to 32 MiB as large arrays are freed) is unmapped whole when freed; one on the heap
stays shared memory once freed (the heap reuses it; nothing else reads it) and is put back in
private pages in a forked child (`_after_fork`, before the child runs anything), so neither
adopted arrays nor such heap pages are shared with a child. Past STALE_BYTES of such pages, heap
buffers are mirrored instead. NCCL_DDP_HOST_ADOPT=0 turns adoption off (mirrors: twins.py).
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
from nccl_ddp.comm.host.segment import SHM_DIR, Segment
from nccl_ddp.errors import CommError

PAGE = mmap.PAGESIZE
MIN_BYTES = 256 << 10  # smaller arrays are not adopted (their edges are a large share of them)
_MAP_FIXED = 0x10  # Linux, every architecture we run on
_IS_MMAPPED = 0x2  # glibc: the chunk's size field flags a chunk in a mapping of its own
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

STALE_BYTES = 1 << 30
_LOCK = threading.Lock()
_ADOPTED: dict = {}  # id(owner array) -> Adopted
_STALE: list = []  # [lo, hi): whole pages of heap buffers freed (or moved) while adopted
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
    return f


def _map_at(addr: int, length: int, flags: int, fd: int, offset: int) -> None:
    f = _mmap_call()
    assert f is not None
    got = f(addr, length, _PROT, flags | _MAP_FIXED, fd, offset)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {addr:#x} ({length} bytes): {os.strerror(err)}")


def _handler_name(a: np.ndarray) -> str:
    import importlib

    try:
        mod = importlib.import_module("numpy._core.multiarray")  # NumPy 2
    except ImportError:  # NumPy 1.x
        mod = importlib.import_module("numpy.core.multiarray")
    return str(mod.get_handler_name(a))


def owner_of(buf: np.ndarray) -> Optional[np.ndarray]:
    """The array that owns `buf`'s memory (`buf` or a base of it), if an array does."""
    o = buf
    while isinstance(o.base, np.ndarray):
        o = o.base
    return o if o.base is None and o.flags.owndata else None


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    except OSError:
        return False


def _own_mapping(owner: np.ndarray) -> bool:
    """`owner`'s buffer (malloc's, NumPy's default allocator) is a glibc chunk in a mapping of
    its own (the chunk header: prev_size, then size | flags, right before the data)."""
    if not _glibc():
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
        inner = (ctypes.c_char * (self.hi - self.lo)).from_address(self.lo)
        seg = Segment.create(-(-(data + n) // PAGE) * PAGE - self.base, fill=(self.lo - self.base, inner))
        try:
            view = seg.array
            mapping, fd, start = shared.publish(seg)
        except BaseException:
            seg.close()
            raise
        self.view, self._mapping, self._fd, self._start = view, mapping, fd, start
        try:
            _map_at(self.lo, self.hi - self.lo, mmap.MAP_SHARED | _POPULATE, fd, self.lo - self.base)
        except BaseException:
            self.release()
            raise
        self.edges = [(data, self.lo), (self.hi, data + n)]
        self.unmapped_when_freed = _own_mapping(owner)

    def twin(self, buf: np.ndarray) -> np.ndarray:
        """`buf` (a view of the adopted array) as it lies in `view`."""
        off = buf.ctypes.data - self.base
        return self.view[off : off + buf.nbytes].view(buf.dtype)

    def release(self) -> None:
        """Unpublish the segment and unmap it here (the array's pages stay as they are)."""
        shared.unpublish(self._start, self._fd)
        del self.view
        try:
            self._mapping.close()
        except BufferError:  # a twin view is still alive: the map goes with it
            pass


def _privatize(ranges: list) -> None:
    """Private pages holding the same bytes put under whatever of `ranges` ([lo, hi) addresses)
    is still mapped shared from /dev/shm (glibc may have unmapped some since)."""
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    mapped = [
        tuple(int(x, 16) for x in m[0].split("-"))
        for m in maps
        if len(m) > 5 and "s" in m[1] and m[5].startswith(SHM_DIR + "/")
    ]
    for lo, hi in ranges:
        for a, b in mapped:
            x, y = max(lo, a), min(hi, b)
            if x < y:
                keep = np.empty(y - x, np.uint8)
                ctypes.memmove(keep.ctypes.data, x, keep.nbytes)
                _map_at(x, keep.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
                ctypes.memmove(x, keep.ctypes.data, keep.nbytes)


def _qualifies(owner: np.ndarray) -> bool:
    """NumPy's own malloc'd buffer, large enough; on the heap only while STALE_BYTES allow."""
    if owner.nbytes < MIN_BYTES or _mmap_call() is None or _handler_name(owner) != "default_allocator":
        return False
    return _own_mapping(owner) or sum(hi - lo for lo, hi in _STALE) < STALE_BYTES


def _drop(key: int, a: Adopted) -> None:
    """Under the lock: `a` is no longer its owner's (dead, or its buffer moved or resized)."""
    del _ADOPTED[key]
    a.release()
    if not a.unmapped_when_freed:
        _STALE.append((a.lo, a.hi))


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
        if a is not None:  # resized (resize(refcheck=False)): realloc moved or resized it
            _drop(key, a)
        if not _qualifies(owner):
            return None
        try:
            a = _ADOPTED[key] = Adopted(owner)
        except (OSError, CommError):  # /dev/shm full, or the kernel refused: the caller mirrors it
            return None
        _STALE[:] = [(lo, hi) for lo, hi in _STALE if not (a.lo <= lo and hi <= a.hi)]
    weakref.finalize(owner, _forget, key, a).atexit = False  # (at exit the arrays stay as they are)
    return a


def _forget(key: int, a: Adopted) -> None:
    """The owner dies: its buffer is freed right after (a mapping of its own unmapped with it)."""
    with _LOCK:
        if _ADOPTED.get(key) is a:
            _drop(key, a)


def _after_fork() -> None:
    """In a forked child, before it runs anything else (one thread): private copies of every
    adopted array's pages and of the freed heap pages that stayed shared; nothing is adopted."""
    global _LOCK
    _LOCK = threading.Lock()  # (another thread may have held it at the fork)
    if _ADOPTED or _STALE:
        _privatize([(a.lo, a.hi) for a in _ADOPTED.values()] + _STALE)
    for a in _ADOPTED.values():
        a.release()
    _ADOPTED.clear()
    _STALE.clear()
    _TRANSPORTS[0] = 0


os.register_at_fork(after_in_child=_after_fork)


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
        _privatize([(a.lo, a.hi) for a in _ADOPTED.values()])
        for a in _ADOPTED.values():
            a.release()
        _ADOPTED.clear()


def count() -> int:
    """Arrays adopted now (for tests and diagnostics)."""
    return len(_ADOPTED)
