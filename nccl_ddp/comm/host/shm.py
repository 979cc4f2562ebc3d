"""The shm transport: collectives between the ranks of one host through segments
(`segment.py`), read (and, for all_reduce, written) in place where every rank's buffer has a
shared twin (`twins.py`: shared memory from `group.zeros`, an adopted array, or a mirror), else
staged chunk by chunk."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from nccl_ddp.comm.host import adopt, flags
from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.comm.host.segment import Segment
from nccl_ddp.comm.host.shared import NOT_SHARED, WHERE, where
from nccl_ddp.comm.host.twins import Twin, Twins
from nccl_ddp.comm.host.wire import SETUP, Header

STAGED, REDUCED = 1, 2  # signal kinds (see wire.KIND_NAMES)

_SLOTS = 3
SMALL_BYTES = 64 << 10  # all_reduce up to this many bytes: every rank reduces the whole message
_NAME_BYTES = 128  # room for a segment's handle
_MAPPED_MAX = 256  # peers' shared segments mapped at once, at most
PIECE_BYTES = 256 << 10  # bytes per piece of an all-reduce on shared buffers (stays in L2)
CHUNK_BYTES = 2 << 20  # default slot size (NCCL_DDP_HOST_CHUNK_BYTES)


def bounds(m: int, j: int, n: int) -> tuple:
    """Elements [a, b) of chunk part j when m elements are split over n ranks."""
    return m * j // n, m * (j + 1) // n


class ShmTransport:
    """Collectives between ranks of one host: each rank stages chunks in its own segment (three
    slots, used in turn, after a cache line of counters) and signals between chunks go through
    those counters (`flags.Flags`; the sockets where stores may be seen out of order): the
    sockets carry the first signal of each op, which checks that every rank runs the same op.

    all_reduce, chunk k split in one part per rank, on every rank r (one signal per chunk):
        stage k: copy chunk k but part r into my slot            (before the loop: stage 0, signal)
        loop k:  part r of my buffer (op)= part r of each peer's slot k; copy it into my slot k
                 stage k+1                     -> signal "reduced k / staged k+1", wait for peers'
                 copy part j of peer j's slot k into my buffer, for every j != r
    Part r is computed once (by rank r), so every rank ends with the same bits. Messages up to
    SMALL_BYTES bytes take one signal: stage all, then every rank reduces all slots in rank order.
    A rank writes a slot again three chunks later; by then every peer has signalled a later
    chunk, which it only does after it finished reading that slot. Where every rank's buffer
    lies in shared memory (`_open` finds out in the first signal) no slot is used: all_reduce
    reduces part r from the peers' buffers and writes it into all of them, reduce_scatter and
    all_gather read the peers' inputs, broadcast the root's, and one last signal ends the op.
    A large buffer that is not shared takes its twin's place (`twins.Twins`: its adopted pages,
    or a mirror it is copied into and out of), so every large op can run in place.
    """

    def __init__(self, links: dict, rank: int, size: int, chunk_bytes: int) -> None:
        self.rank, self.size = rank, size
        self.chunk = max(4096, (chunk_bytes or CHUNK_BYTES) // 64 * 64)
        self.links = [links[j] for j in range(size) if j != rank]
        self.seq = 0  # signals exchanged so far
        self.chunks = 0  # chunks staged so far: chunk c uses slot c % _SLOTS
        self._mapped: dict = {}  # a peer's shared segment key -> [its Segment here, last op used]
        self._ops = 0  # large all-reduces on shared buffers so far
        nbytes = flags.FLAG_BYTES + _SLOTS * self.chunk
        self._own = Segment.create(nbytes, sharers=size)
        segments = {}
        try:
            name = self._own.handle.encode().ljust(_NAME_BYTES, b"\0")
            hello = Header(0, STAGED, SETUP, count=nbytes)
            for link in self.links:
                link.send(hello, memoryview(name))
            for j, link in zip((j for j in range(size) if j != rank), self.links):
                link.expect(hello)
                raw = bytearray(_NAME_BYTES)
                link.recv_into(memoryview(raw))
                segments[j] = Segment.attach(bytes(raw).rstrip(b"\0").decode(), nbytes, j)
            self._exchange((SETUP, 0, 0, 0, 0), REDUCED)  # everyone mapped everything: release
        except BaseException:
            for seg in segments.values():
                seg.close()
            self._own.close()
            raise
        self._own.release()
        segments[rank] = self._own
        self._segments = segments
        base = flags.FLAG_BYTES
        self.slots = [
            [segments[j].array[base + i * self.chunk : base + (i + 1) * self.chunk] for i in range(_SLOTS)]
            for j in range(size)
        ]
        self.flags = (
            flags.Flags(
                [segments[j].array[:8].view(np.int64) for j in range(size)],
                rank,
                self.links,
                self.links[0].timeout,
            )
            if flags.available()
            else None
        )
        self.twins = Twins()
        adopt.hold()

    def _step(self) -> int:
        """The slot of the next chunk."""
        self.chunks += 1
        return self.chunks % _SLOTS

    def _signal(self, desc: tuple, kind: int, first: bool = False) -> None:
        """A signal of one op: its first over the sockets (`_exchange`, which checks that every
        rank runs this op), the ones between its chunks through the counters where available."""
        if first or self.flags is None:
            self._exchange(desc, kind)
        else:
            self.flags.signal()

    def _exchange(self, desc: tuple, kind: int, payload: bytes = b"") -> list:
        """A signal over the sockets, checking that every peer sent the same header; with
        `payload`, every peer sends one of the same size too: returns them in group-rank order."""
        self.seq += 1
        hdr = Header(self.seq, kind, *desc)
        for link in self.links:
            link.send(hdr, memoryview(payload))
        got = []
        for link in self.links:
            link.expect(hdr)
            raw = bytearray(len(payload))
            if payload:
                link.recv_into(memoryview(raw))
            got.append(bytes(raw))
        return got

    def _peer_arrays(self, buf: np.ndarray, mine: bytes, desc: tuple, root: Optional[int] = None) -> tuple:
        """An op's first signal (`_open`'s), which also tells where each rank's buffer is
        (`mine`: `where(buf)`). If every rank's (with `root`: that rank's) lies in a shared
        segment: the peers' buffers mapped here (None at this rank's index and the ranks not
        counted), else None (the staged path, on every rank alike); and whether some but not
        all ranks' buffers are shared."""
        found = [WHERE.unpack(w) for w in self._exchange(desc, STAGED, mine)]
        found.insert(self.rank, WHERE.unpack(mine))
        counted = range(self.size) if root is None else [root]
        n_shared = sum(found[j][1] != 0 for j in counted)
        if n_shared < len(counted) or any(f[2] != found[self.rank][2] for f in found):
            # (ranks that scale by different factors: each scales its own, on the staged path)
            return None, n_shared > 0
        self._ops += 1
        peers: list = [None] * self.size
        for j in counted:
            if j == self.rank:
                continue
            offset, nbytes, _, key = found[j]
            text = key.rstrip(b"\0").decode()
            hit = self._mapped.get(text)
            if hit is None:
                seg = Segment.attach(text.rsplit(":", 1)[0], nbytes, self.links[j - (j > self.rank)].peer)
                hit = self._mapped[text] = [seg, 0]
            hit[1] = self._ops
            peers[j] = hit[0].array[offset : offset + buf.nbytes].view(buf.dtype)
        if len(self._mapped) > _MAPPED_MAX or self._ops % 256 == 0:
            self._forget_unused()
        return peers, False

    def _forget_unused(self) -> None:
        """Unmap peers' segments not read in the last 1024 large all-reduces (freed or rebuilt
        buckets: their pages stay allocated while mapped here)."""
        for key, (seg, last) in list(self._mapped.items()):
            if self._ops - last > 1024 or len(self._mapped) > _MAPPED_MAX:
                del self._mapped[key]
                seg.close()

    def _all_reduce_in_place(self, buf: np.ndarray, peers: list, red: Reduction, desc: tuple) -> None:
        """Every rank's buffer is mapped here: reduce part `rank` straight from the peers' buffers
        and write the result into theirs too, piece by piece (PIECE_BYTES: the piece just read
        and reduced is still in this core's cache when it is written out; a peer reading it
        would fetch it from this core's cache instead); then one signal, before returning, so no
        rank reads its buffer before every part is in. No rank reads what another writes during
        the op: part j of every buffer is read and written by rank j alone."""
        a, b = bounds(buf.size, self.rank, self.size)
        theirs = [peers[j] for j in range(self.size) if j != self.rank]
        step = max(1, PIECE_BYTES // buf.itemsize)
        tmp = None
        if red.prescales:  # the scale fused in, through cached temporaries: the same bits
            tmp = [np.empty(step, buf.dtype) for _ in theirs]
        for x in range(a, b, step):
            y = min(b, x + step)
            mine = buf[x:y]
            if tmp is None:
                red.combine(mine, [p[x:y] for p in theirs], True)
            else:
                red.scaled(mine, mine)
                red.combine(mine, [red.scaled(t[: y - x], p[x:y]) for t, p in zip(tmp, theirs)], True)
            for p in theirs:
                np.copyto(p[x:y], mine)
        self._signal(desc, REDUCED)

    def _slot(self, j: int, s: int, a: int, b: int, dtype: Any) -> np.ndarray:
        it = dtype.itemsize
        return self.slots[j][s][a * it : b * it].view(dtype)

    def _twin(self, buf: np.ndarray) -> Optional[Twin]:
        """The shared twin of a buffer its peers read, its private bytes copied in; None for a
        small one (one signal, staged) or where there is none."""
        if buf.nbytes <= SMALL_BYTES:
            return None
        tw = self.twins.get(buf)
        if tw is not None:
            tw.load(buf)
        return tw

    def _open(
        self, buf: np.ndarray, desc: tuple, stage0: Callable[[], None], prescale: float = 1.0
    ) -> Optional[list]:
        """An op's first signal, over the sockets, telling where each rank's `buf` (its twin
        where it has one: the buffer its peers read) is: the peers' twins mapped here (None at
        this rank's index) if every rank's lies in a shared segment, else None after `stage0()`
        (its first chunk, from the buffer itself, into the slots) ran on every rank before the
        op's next signal: before the first where this rank has no twin, as when no rank has
        one; after it, then one more signal on every rank, where only some ranks have."""
        mine = where(buf, prescale)
        if mine is NOT_SHARED:
            stage0()
        peers, mixed = self._peer_arrays(buf, mine, desc)
        if peers is not None:
            return peers
        if mine is not NOT_SHARED:
            stage0()
        if mixed:
            self._signal(desc, STAGED)
        return None

    def all_reduce(self, buf: np.ndarray, red: Reduction, desc: tuple) -> None:
        n, dt, r, size = buf.size, buf.dtype, self.rank, self.size
        if buf.nbytes <= min(SMALL_BYTES, self.chunk):
            # one signal instead of two: every rank reduces all of it, in the same rank order
            red.scale_all(buf)
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
            a, b = bounds(hi - lo, r, size)
            # peers need every part but mine, which I reduce straight from my buffer
            np.copyto(self._slot(r, s, 0, a, dt), buf[lo : lo + a])
            np.copyto(self._slot(r, s, b, hi - lo, dt), buf[lo + b : hi])
            return lo, hi, s

        first: list = []

        def stage0() -> None:
            red.scale_all(buf)
            first.append(stage(0))

        tw = self._twin(buf)
        read = buf if tw is None else tw.view  # what the peers read: a twin, or buf if shared
        peers = self._open(read, desc, stage0, red.prescale)
        if peers is not None:
            self._all_reduce_in_place(read, peers, red, desc)
            if tw is not None:
                tw.store(buf)
            return
        cur = first[0]
        for k in range(len(starts)):
            lo, hi, s = cur
            a, b = bounds(hi - lo, r, size)
            mine = buf[lo + a : lo + b]
            red.combine(mine, [self._slot(j, s, a, b, dt) for j in range(size) if j != r], True)
            np.copyto(self._slot(r, s, a, b, dt), mine)
            if k + 1 < len(starts):
                cur = stage(starts[k + 1])
            self._signal(desc, REDUCED)
            for j in range(size):
                if j != r:
                    a, b = bounds(hi - lo, j, size)
                    np.copyto(buf[lo + a : lo + b], self._slot(j, s, a, b, dt))

    def broadcast(self, buf: np.ndarray, root: int, desc: tuple) -> None:
        """The root's buffer read in place where it has a shared twin (the first signal says),
        else staged chunk by chunk, as are small ones."""
        n, dt, r = buf.size, buf.dtype, self.rank

        def stage(lo: int) -> None:
            hi, s = min(n, lo + self.chunk // dt.itemsize), self._step()
            if r == root:
                np.copyto(self._slot(root, s, 0, hi - lo, dt), buf[lo:hi])

        if buf.nbytes <= SMALL_BYTES:
            stage(0)
            self._exchange(desc, STAGED)
        else:
            tw = self._twin(buf) if r == root else None
            mine = NOT_SHARED if tw is None else where(tw.view)
            if r == root and tw is None:
                stage(0)  # before the first signal: the peers read it after
            peers, _ = self._peer_arrays(buf, mine, desc, root)
            if peers is not None:
                if r != root:
                    np.copyto(buf, peers[root])
                self._signal(desc, REDUCED)  # the root keeps its buffer until every peer read it
                return
            if r != root:
                stage(0)  # (the slot counter only: the root staged its chunk before)
        for lo, hi, s in self._chunks(n, self.chunk // dt.itemsize, stage, desc):
            if r != root:
                np.copyto(buf[lo:hi], self._slot(root, s, 0, hi - lo, dt))

    def all_gather(self, out: np.ndarray, inp: np.ndarray, desc: tuple) -> None:
        """Peers' inputs read in place where every rank's lies in shared memory (ZeRO's
        parameter shards: each a slice of its rank's shared bucket), else staged chunk by chunk."""
        n = inp.size

        def copy(parts: Sequence[np.ndarray]) -> None:
            for j, src in enumerate(parts):
                part = out[j * n : (j + 1) * n]
                if part.ctypes.data != src.ctypes.data:  # (ZeRO's own shard is already in place)
                    np.copyto(part, src)

        self._gather(inp, desc, copy, lambda: out)

    def all_gather_parts(
        self, inp: np.ndarray, apply: Callable[[Sequence[np.ndarray]], None], desc: tuple
    ) -> None:
        """`apply(parts)`, `parts[j]` rank j's `inp`: the peers' own memory where every rank's
        lies in shared memory (ZeRO-3's shards; read before the op's last signal, so no copy of
        the gathered whole), else views of a buffer the inputs were staged into."""
        self._gather(inp, desc, apply, None)

    def _gather(
        self,
        inp: np.ndarray,
        desc: tuple,
        in_place: Callable[[Sequence[np.ndarray]], None],
        out: Optional[Callable[[], np.ndarray]],
    ) -> None:
        """An all-gather: `in_place(parts)` on the peers' inputs where all are shared, else
        staged into `out()` (None: a buffer of its own, then handed to `in_place` as parts)."""
        n, dt = inp.size, inp.dtype
        ce = self.chunk // dt.itemsize

        def stage(lo: int) -> None:
            hi, s = min(n, lo + ce), self._step()
            np.copyto(self._slot(self.rank, s, 0, hi - lo, dt), inp[lo:hi])

        tw = self._twin(inp)
        peers = self._open(inp if tw is None else tw.view, desc, lambda: stage(0))
        if peers is not None:
            in_place([inp if j == self.rank else peers[j] for j in range(self.size)])
            self._signal(desc, REDUCED)  # no rank changes its input while a peer still reads it
            return
        dst = np.empty(self.size * n, dt) if out is None else out()
        for lo, hi, s in self._chunks(n, ce, stage, desc):
            for j in range(self.size):
                np.copyto(dst[j * n + lo : j * n + hi], self._slot(j, s, 0, hi - lo, dt))
        if out is None:
            in_place([dst[j * n : (j + 1) * n] for j in range(self.size)])

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, red: Reduction, desc: tuple) -> None:
        """Part `rank` of every rank's input reduced into `out`, in rank order after this rank's
        own: read in place where every rank's input lies in shared memory (ZeRO-2's grad
        pool), else staged chunk by chunk."""
        n, dt, r, size = out.size, out.dtype, self.rank, self.size
        parts = inp.reshape(size, n)
        ce = max(1, self.chunk // (dt.itemsize * size))

        def stage(lo: int) -> None:
            hi, s = min(n, lo + ce), self._step()
            np.copyto(self._slot(r, s, 0, size * (hi - lo), dt).reshape(size, hi - lo), parts[:, lo:hi])

        tw = self._twin(inp)
        peers = self._open(inp if tw is None else tw.view, desc, lambda: stage(0))
        if peers is not None:
            np.copyto(out, parts[r])
            red.combine(out, [peers[j].reshape(size, n)[r] for j in range(size) if j != r], final=True)
            self._signal(desc, REDUCED)  # no rank changes its input while a peer still reads it
            return
        for lo, hi, s in self._chunks(n, ce, stage, desc):
            m = hi - lo
            np.copyto(out[lo:hi], parts[r, lo:hi])
            others = [self._slot(j, s, r * m, (r + 1) * m, dt) for j in range(size) if j != r]
            red.combine(out[lo:hi], others, final=True)

    def _chunks(self, n: int, ce: int, stage: Callable[[int], None], desc: tuple) -> Iterator[tuple]:
        """(lo, hi, slot) of each chunk of a staged op whose first chunk `_open` staged: the
        later ones staged here, each followed by a signal."""
        for lo in range(0, max(n, 1), ce):
            if lo:
                stage(lo)
                self._signal(desc, STAGED)
            yield lo, min(n, lo + ce), self.chunks % _SLOTS

    def barrier(self, desc: tuple) -> None:
        self._exchange(desc, STAGED)

    def close(self) -> None:
        self.twins.close()
        adopt.let_go()
        self.slots, self.flags = [], None  # (views of the segments: they would keep them mapped)
        for seg, _ in self._mapped.values():
            seg.close()
        self._mapped = {}
        for seg in self._segments.values():
            seg.close()
        self._segments = {}
