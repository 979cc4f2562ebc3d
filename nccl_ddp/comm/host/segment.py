"""Shared-memory segments without a name: an unnamed file in /dev/shm's tmpfs (O_TMPFILE), mapped
with mmap, that peers open through its creator's /proc/<pid>/fd/<n>.

No path in /dev/shm ever names a segment, so nothing outlives its creator however it dies, with
or without our launcher (a SIGKILL between creating and sharing it included): the pages go when
the last process that maps them exits. The creator keeps the descriptor open only until every peer
has mapped it (a shared buffer's for as long as it lives: shared.py). A segment's pages are
allocated when it is created: a /dev/shm too small for it is a `CommError` at setup, not a SIGBUS
at the first collective that touches it.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import NoReturn, Optional

import numpy as np

from nccl_ddp.errors import CommError

SHM_DIR = "/dev/shm"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Segment:
    """One mapped segment; `array` is a uint8 view of all of it, `handle` what a peer of this
    host passes to `attach` while the creator still holds the descriptor (until `release`)."""

    def __init__(self, fd: int, nbytes: int, owner: bool) -> None:
        try:  # (populated: its page tables filled at once, not one fault per page on first touch)
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        st = os.fstat(fd)
        self.handle = f"{os.getpid()}:{fd}:{st.st_dev}:{st.st_ino}"
        self._fd: Optional[int] = fd
        if not owner:
            self.release()
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, nbytes: int, sharers: int = 1, fill: Optional[tuple] = None) -> Segment:
        """A new segment of `nbytes`, its pages reserved. `sharers`: how many processes of this
        host create one alike (for the error when /dev/shm is full). `fill`: (offset, bytes-like)
        written at that offset first (tmpfs then allocates those pages and copies in one pass,
        without zeroing them first)."""
        try:
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as e:  # no O_TMPFILE on this tmpfs: an anonymous memory file
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            fd = os.memfd_create("nccl_ddp-segment", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            if fill is not None:
                _write(fd, fill[0], memoryview(fill[1]).cast("B"), sharers)
            _allocate(fd, nbytes, sharers)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, owner=True)

    @classmethod
    def attach(cls, handle: str, nbytes: int, peer: int) -> Segment:
        """Map peer rank `peer`'s segment from its `handle` (same host, same PID namespace)."""
        pid, num, dev, ino = (int(x) for x in handle.split(":"))
        path = f"/proc/{pid}/fd/{num}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise CommError(
                f"cannot map peer rank {peer}'s shared-memory segment through {path} ({e.strerror}): "
                f"the peer exited during setup, or it runs in another PID namespace or /proc is "
                f"restricted; set NCCL_DDP_HOST_TRANSPORT=tcp in the last two cases"
            ) from e
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, nbytes):
            os.close(fd)
            raise CommError(
                f"{path} is not peer rank {peer}'s segment of {nbytes} bytes (the peer exited and "
                f"its pid was reused?); restart the job"
            )
        return cls(fd, nbytes, owner=False)

    def keep_open(self) -> tuple:
        """(the mapping, the descriptor) handed to a caller that keeps peers able to map the
        segment for as long as the mapping lives (`shared.shared_zeros`); this object lets go."""
        if self._map is None or self._fd is None:
            raise CommError("keep_open on a segment already released or closed")
        out = (self._map, self._fd)
        self._fd = None
        return out

    def release(self) -> None:
        """Close the descriptor peers open the segment through (the mapping stays). Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        """Release and unmap. Views of `array` must be gone first."""
        self.release()
        if self._map is not None:
            del self.array
            try:
                self._map.close()
            except BufferError:  # a view is still alive; the map is freed with it
                pass
            self._map = None


def _write(fd: int, offset: int, data: memoryview, sharers: int) -> None:
    done = 0
    while done < data.nbytes:
        try:
            done += os.pwrite(fd, data[done:], offset + done)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            _too_small(e, offset + data.nbytes, sharers)


def _allocate(fd: int, nbytes: int, sharers: int) -> None:
    """Reserve the segment's pages now; tmpfs otherwise hands them out on first touch and a full
    /dev/shm kills the process with SIGBUS there."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        _too_small(e, nbytes, sharers)


def _too_small(e: OSError, nbytes: int, sharers: int) -> NoReturn:
    """Raise the CommError of a /dev/shm without room for a segment of `nbytes`."""
    try:
        st = os.statvfs(SHM_DIR)
        free = f"{_mib(st.f_bavail * st.f_frsize)} free"
    except OSError:
        free = "its free space unknown"
    raise CommError(
        f"{SHM_DIR} is too small for the shm transport: a segment of {_mib(nbytes)} does not "
        f"fit ({e.strerror}); {sharers} rank(s) on this host need {_mib(nbytes * sharers)} "
        f"in all, {SHM_DIR} has {free}. Set NCCL_DDP_HOST_TRANSPORT=tcp, enlarge {SHM_DIR} "
        f"(docker run --shm-size), or lower NCCL_DDP_HOST_CHUNK_BYTES"
    ) from e


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB ({n} bytes)"
