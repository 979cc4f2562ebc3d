"""Shared-memory segments in /dev/shm, mapped with mmap (no multiprocessing resource tracker).

The owner unlinks its segment as soon as every peer has mapped it, so a crash after setup leaves
nothing behind in /dev/shm. A segment's pages are allocated when it is created: a /dev/shm too
small for it is a `CommError` at setup, not a SIGBUS at the first collective that touches it.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from typing import Any, Optional

import numpy as np

from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.comm.host.wire import SETUP, Header
from nccl_ddp.errors import CommError

SHM_DIR = "/dev/shm"


class Segment:
    """One mapped segment; `array` is a uint8 view of all of it."""

    def __init__(self, name: str, nbytes: int, create: bool, sharers: int = 1) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
                _allocate(fd, nbytes, sharers)
            elif os.fstat(fd).st_size != nbytes:
                raise OSError(f"segment {self.path} has {os.fstat(fd).st_size} bytes, expected {nbytes}")
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, nbytes: int, tag: str, sharers: int = 1) -> Segment:
        """A new segment named `nccl_ddp-<job>-<pid>-<random>`: $NCCL_DDP_JOB_ID (set by
        nccl-ddp-run, which removes `nccl_ddp-<job>-*` when it exits) or `tag`. `sharers`: how
        many processes of this host create one alike (for the error when /dev/shm is full)."""
        job = os.environ.get("NCCL_DDP_JOB_ID") or tag
        return cls(
            f"nccl_ddp-{job}-{os.getpid()}-{secrets.token_hex(4)}", nbytes, create=True, sharers=sharers
        )

    def unlink(self) -> None:
        """Remove the name (mappings stay valid). Idempotent."""
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink if still owned and unmap. Views of `array` must be gone first."""
        self.unlink()
        if self._map is not None:
            del self.array
            try:
                self._map.close()
            except BufferError:  # a view is still alive; the map is freed with it
                pass
            self._map = None


def _allocate(fd: int, nbytes: int, sharers: int) -> None:
    """Reserve the segment's pages now; tmpfs otherwise hands them out on first touch and a full
    /dev/shm kills the process with SIGBUS there."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
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


STAGED, REDUCED = 1, 2  # signal kinds (see _wire.KIND_NAMES)
_SLOTS = 3
_SMALL = 64 << 10  # all_reduce up to this many bytes: every rank reduces the whole message
_NAME_BYTES = 128


def _bounds(m: int, j: int, n: int) -> tuple:
    """Elements [a, b) of chunk part j when m elements are split over n ranks."""
    return m * j // n, m * (j + 1) // n


class ShmTransport:
    """Collectives between ranks of one host: each rank stages chunks in its own segment (three
    slots, used in turn) and the sockets carry only small signals.

    all_reduce, chunk k split in one part per rank, on every rank r (one signal per chunk):
        stage k: copy chunk k but part r into my slot            (before the loop: stage 0, signal)
        loop k:  part r of my buffer (op)= part r of each peer's slot k; copy it into my slot k
                 stage k+1                     -> signal "reduced k / staged k+1", wait for peers'
                 copy part j of peer j's slot k into my buffer, for every j != r
    Part r is computed once (by rank r), so every rank ends with the same bits. Messages up to
    _SMALL bytes take one signal: stage all, then every rank reduces all slots in rank order.
    A rank writes a slot again three chunks later; by then every peer has signalled a later
    chunk, which it only does after it finished reading that slot.
    """

    def __init__(self, links: dict, rank: int, size: int, chunk_bytes: int, tag: str) -> None:
        self.rank, self.size = rank, size
        self.chunk = max(4096, chunk_bytes // 64 * 64)
        self.links = [links[j] for j in range(size) if j != rank]
        self.seq = 0  # signals exchanged so far
        self.chunks = 0  # chunks staged so far: chunk c uses slot c % _SLOTS
        nbytes = _SLOTS * self.chunk
        self._own = Segment.create(nbytes, tag, sharers=size)
        segments = {}
        try:
            name = self._own.name.encode().ljust(_NAME_BYTES, b"\0")
            hello = Header(0, STAGED, SETUP, count=nbytes)
            for link in self.links:
                link.send(hello, memoryview(name))
            for j, link in zip((j for j in range(size) if j != rank), self.links):
                link.expect(hello)
                raw = bytearray(_NAME_BYTES)
                link.recv_into(memoryview(raw))
                segments[j] = Segment(bytes(raw).rstrip(b"\0").decode(), nbytes, False)
            self._exchange((SETUP, 0, 0, 0, 0), REDUCED)  # everyone mapped everything: unlink
        except BaseException:
            for seg in segments.values():
                seg.close()
            self._own.close()
            raise
        self._own.unlink()
        segments[rank] = self._own
        self._segments = segments
        self.slots = [
            [segments[j].array[i * self.chunk : (i + 1) * self.chunk] for i in range(_SLOTS)]
            for j in range(size)
        ]

    def _step(self) -> int:
        """The slot of the next chunk."""
        self.chunks += 1
        return self.chunks % _SLOTS

    def _exchange(self, desc: tuple, kind: int) -> None:
        self.seq += 1
        hdr = Header(self.seq, kind, *desc)
        for link in self.links:
            link.send(hdr)
        for link in self.links:
            link.expect(hdr)

    def _slot(self, j: int, s: int, a: int, b: int, dtype: Any) -> np.ndarray:
        it = dtype.itemsize
        return self.slots[j][s][a * it : b * it].view(dtype)

    def all_reduce(self, buf: np.ndarray, red: Reduction, desc: tuple) -> None:
        n, dt, r, size = buf.size, buf.dtype, self.rank, self.size
        if buf.nbytes <= min(_SMALL, self.chunk):
            # one signal instead of two: every rank reduces all of it, in the same rank order
            s = self._step()
            np.copyto(self._slot(r, s, 0, n, dt), buf)
            self._exchange(desc, STAGED)
            np.copyto(buf, self._slot(0, s, 0, n, dt))
            red.combine(buf, [self._slot(j, s, 0, n, dt) for j in range(1, size)], True)
            return
        ce = self.chunk // dt.itemsize
        starts = range(0, max(n, 1), ce)

        def stage(lo: int) -> tuple:
            hi, s = min(n, lo + ce), self._step()
            a, b = _bounds(hi - lo, r, size)
            # peers need every part but mine, which I reduce straight from my buffer
            np.copyto(self._slot(r, s, 0, a, dt), buf[lo : lo + a])
            np.copyto(self._slot(r, s, b, hi - lo, dt), buf[lo + b : hi])
            return lo, hi, s

        cur = stage(0)
        self._exchange(desc, STAGED)
        for k in range(len(starts)):
            lo, hi, s = cur
            a, b = _bounds(hi - lo, r, size)
            mine = buf[lo + a : lo + b]
            red.combine(mine, [self._slot(j, s, a, b, dt) for j in range(size) if j != r], True)
            np.copyto(self._slot(r, s, a, b, dt), mine)
            if k + 1 < len(starts):
                cur = stage(starts[k + 1])
            self._exchange(desc, REDUCED)
            for j in range(size):
                if j != r:
                    a, b = _bounds(hi - lo, j, size)
                    np.copyto(buf[lo + a : lo + b], self._slot(j, s, a, b, dt))

    def broadcast(self, buf: np.ndarray, root: int, desc: tuple) -> None:
        n, dt = buf.size, buf.dtype
        ce = self.chunk // dt.itemsize
        for lo in range(0, max(n, 1), ce):
            hi = min(n, lo + ce)
            s = self._step()
            if self.rank == root:
                np.copyto(self._slot(root, s, 0, hi - lo, dt), buf[lo:hi])
            self._exchange(desc, STAGED)
            if self.rank != root:
                np.copyto(buf[lo:hi], self._slot(root, s, 0, hi - lo, dt))

    def all_gather(self, out: np.ndarray, inp: np.ndarray, desc: tuple) -> None:
        n, dt = inp.size, inp.dtype
        ce = self.chunk // dt.itemsize
        for lo in range(0, max(n, 1), ce):
            hi = min(n, lo + ce)
            s = self._step()
            np.copyto(self._slot(self.rank, s, 0, hi - lo, dt), inp[lo:hi])
            self._exchange(desc, STAGED)
            for j in range(self.size):
                np.copyto(out[j * n + lo : j * n + hi], self._slot(j, s, 0, hi - lo, dt))

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, red: Reduction, desc: tuple) -> None:
        n, dt, r, size = out.size, out.dtype, self.rank, self.size
        parts = inp.reshape(size, n)
        ce = max(1, self.chunk // (dt.itemsize * size))
        for lo in range(0, max(n, 1), ce):
            hi = min(n, lo + ce)
            m = hi - lo
            s = self._step()
            np.copyto(self._slot(r, s, 0, size * m, dt).reshape(size, m), parts[:, lo:hi])
            self._exchange(desc, STAGED)
            np.copyto(out[lo:hi], parts[r, lo:hi])
            others = [self._slot(j, s, r * m, (r + 1) * m, dt) for j in range(size) if j != r]
            red.combine(out[lo:hi], others, final=True)

    def barrier(self, desc: tuple) -> None:
        self._exchange(desc, STAGED)

    def close(self) -> None:
        self.slots = []
        for seg in self._segments.values():
            seg.close()
        self._segments = {}
