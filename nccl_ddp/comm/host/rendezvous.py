"""How the ranks of a host group find each other: each publishes its address and a token in the
store, then dials the lower ranks and accepts the higher ones, checking every handshake, and
names the ranks still missing every NOTICE_EVERY seconds. The links it makes are wire.PeerLinks.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from nccl_ddp.comm.host.wire import PeerLink
from nccl_ddp.errors import CommError, CommTimeout, ConfigError, StoreTimeout

log = logging.getLogger(__name__)

_HANDSHAKE = struct.Struct("<32sI")  # acceptor's token, connector's group rank
_ACCEPTED = b"\x01"  # the acceptor's confirmation of a valid handshake
HANDSHAKE_DEADLINE = 5.0  # seconds a connection to the listener has to identify
NOTICE_EVERY = 30.0  # seconds between the warnings naming the ranks a rendezvous still waits for
MAX_UNAUTHENTICATED = 64  # handshakes in progress at once; then one is evicted


def advertise_host() -> str:
    """The address peers reach this process on: $NCCL_DDP_SOCKET_ADDR, else the local address of
    the route to $MASTER_ADDR, else 127.0.0.1."""
    explicit = os.environ.get("NCCL_DDP_SOCKET_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))
                return s.getsockname()[0]
        except OSError:
            log.debug("no route to MASTER_ADDR=%s; advertising 127.0.0.1", master)
    return "127.0.0.1"


def host_id() -> str:
    """Equal for processes that can share shm segments: the same /dev/shm and the same PID
    namespace (a peer opens a segment through its creator's /proc/<pid>/fd)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat("/dev/shm")
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"  # no /dev/shm: never shared
    return f"{socket.gethostname()}:{boot}:{st.st_dev}:{st.st_ino}:{pidns}"


class Rendezvous:
    """Publishes this rank's listening address in the store, reads the others', and connects the
    links a transport asks for (the higher group rank dials, the lower one accepts)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        ranks: List[int],
        timeout: float,
        where: str,
        extra: dict,
        origin: str = "",
        notice_every: Optional[float] = None,
    ) -> None:
        self.store, self.rank, self.ranks, self.timeout, self.where = (store, rank, ranks, timeout, where)
        self.origin = origin  # "world size 2 from OMPI_COMM_WORLD_SIZE=2 (Open MPI)"
        self.notice_every = NOTICE_EVERY if notice_every is None else notice_every
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.token = secrets.token_hex(16)
        host = advertise_host()
        try:
            self.listener = socket.create_server((host, 0), backlog=max(8, len(ranks)))
        except OSError as e:
            raise ConfigError(
                f"{where}: cannot listen for peers on {host!r} ({e}); set "
                f"NCCL_DDP_SOCKET_ADDR to an address of this machine (or unset it "
                f"to use the route to MASTER_ADDR)"
            ) from e
        self.listener.settimeout(timeout)
        info = dict(extra, addr=host, port=self.listener.getsockname()[1], token=self.token)
        try:
            store.set(f"peer/{rank}", json.dumps(info))
            self.infos = self._gather()
        except BaseException:
            self.listener.close()
            raise

    def _left(self) -> float:
        return max(0.01, self.deadline - time.monotonic())

    def _gather(self) -> List[dict]:
        """Every member's published address; while some are missing, a WARNING every
        `notice_every` seconds names them and where the group's size came from (a launcher
        environment that counts more processes than run waits silently otherwise)."""
        infos: Dict[int, dict] = {}
        notice = self.start + self.notice_every
        for r in range(len(self.ranks)):
            while r not in infos:
                try:
                    wait = min(self._left(), max(0.01, notice - time.monotonic()))
                    infos[r] = json.loads(self.store.get(f"peer/{r}", timeout=wait))
                except StoreTimeout as e:
                    if time.monotonic() < self.deadline:
                        log.warning("%s", self._waiting(infos, "still waiting for"))
                        notice += self.notice_every
                        continue
                    missing, joined = self._missing(infos)
                    raise CommTimeout(
                        f"{self.where}: ranks {missing} did not join within {self.timeout:.1f}s "
                        f"({joined}; they never published their address; did they start, crash, "
                        f"or call init_process_group/new_group with different arguments?)"
                    ) from e
        return [infos[r] for r in range(len(self.ranks))]

    def _missing(self, infos: Dict[int, dict]) -> Tuple[List[int], str]:
        """The members not yet here, and "1 of 2 joined; world size 2 from ..."."""
        missing = [self.ranks[q] for q in range(len(self.ranks)) if q not in infos and not self._present(q)]
        size = f"; {self.origin}" if self.origin else ""
        return missing, f"{len(self.ranks) - len(missing)} of {len(self.ranks)} joined{size}"

    def _waiting(self, infos: Dict[int, dict], what: str) -> str:
        missing, joined = self._missing(infos)
        return (
            f"{self.where}: {what} ranks {missing} after {time.monotonic() - self.start:.0f}s "
            f"of the {self.timeout:g}s timeout ({joined})"
        )

    def _present(self, r: int) -> bool:
        try:
            self.store.get(f"peer/{r}", timeout=0.05)
            return True
        except StoreTimeout:
            return False

    def connect(self, peers: Iterable[int]) -> Dict[int, PeerLink]:
        """Links to the given group ranks, keyed by group rank."""
        peers = sorted(set(peers) - {self.rank})
        links: Dict[int, PeerLink] = {}
        try:
            for p in (p for p in peers if p < self.rank):
                links[p] = self._dial(p)
            expected = {p for p in peers if p > self.rank}
            if expected:
                links.update(self._accept_all(expected))
        except BaseException:
            for link in links.values():
                link.close()
            raise
        finally:
            self.listener.close()
        return links

    def _dial(self, p: int) -> PeerLink:
        """Connect to group rank `p` and identify; the acceptor confirms with one byte. A
        connection it closed unconfirmed (evicted or timed out under a flood of strangers, or
        on a starved machine) is dialed again until the deadline."""
        info = self.infos[p]
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((info["addr"], info["port"]), timeout=self._left())
            except OSError as e:
                # "peer rank N": the launcher blames that rank (a refused connection at setup is
                # usually a peer that died after publishing its address)
                raise CommError(
                    f"{self.where}: cannot connect to peer rank {self.ranks[p]} at "
                    f"{info['addr']}:{info['port']} ({e}); check that the address "
                    f"is reachable or set NCCL_DDP_SOCKET_ADDR"
                ) from e
            try:
                sock.sendall(_HANDSHAKE.pack(info["token"].encode(), self.rank))
                sock.settimeout(self._left())
                if sock.recv(1) == _ACCEPTED:
                    return PeerLink(sock, self.ranks[p], self.timeout)
                why = "closed the connection during the handshake"
            except TimeoutError as e:
                sock.close()
                raise CommTimeout(
                    f"{self.where}: peer rank {self.ranks[p]} did not confirm "
                    f"the connection within {self.timeout:.1f}s"
                ) from e
            except OSError as e:
                why = f"dropped the connection during the handshake ({e})"
            sock.close()
            if time.monotonic() + delay >= self.deadline:
                raise CommError(
                    f"{self.where}: peer rank {self.ranks[p]} {why} until the {self.timeout:.1f}s timeout"
                )
            log.debug("%s: peer rank %d %s; dialing again", self.where, self.ranks[p], why)
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _accept_all(self, expected: set) -> Dict[int, PeerLink]:
        """Accept until every rank in `expected` (group ranks) completed its handshake.

        The store's rules for strangers: every connection gets HANDSHAKE_DEADLINE seconds to send
        its fixed-size handshake (nothing more is read before it checks out), handshakes proceed
        side by side, and at most MAX_UNAUTHENTICATED wait at once (a new one evicts the oldest
        that sent nothing, else the oldest). So a process that connects and stays silent costs
        a peer nothing, instead of the whole timeout."""
        sel = selectors.DefaultSelector()
        pending: Dict[socket.socket, _Handshake] = {}  # insertion order: oldest first
        links: Dict[int, PeerLink] = {}
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        try:
            while expected:
                now = time.monotonic()
                if now >= self.deadline:
                    raise CommTimeout(
                        f"{self.where}: ranks "
                        f"{[self.ranks[p] for p in sorted(expected)]} did not "
                        f"connect within {self.timeout:.1f}s"
                    )
                wake = min([self.deadline] + [h.deadline for h in pending.values()])
                for key, _ in sel.select(max(0.0, wake - now)):
                    # a peer sends its handshake with its connect: read at once what came
                    sock = self._admit(sel, pending) if key.fileobj is self.listener else key.fileobj
                    got = None if sock is None else self._read_handshake(sel, pending, sock, expected)
                    if got is not None:
                        links[got[0]] = got[1]
                now = time.monotonic()
                for sock, h in list(pending.items()):
                    if h.deadline <= now:
                        self._drop(sel, pending, sock, f"no handshake within {HANDSHAKE_DEADLINE:g}s")
        except BaseException:
            for link in links.values():
                link.close()
            raise
        finally:
            for sock in list(pending):
                self._drop(sel, pending, sock, None)
            sel.close()
        return links

    def _admit(
        self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake]
    ) -> Optional[socket.socket]:
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:  # out of descriptors: make room, the peer's dial waits
            log.warning("%s: cannot accept a peer connection (%s)", self.where, e)
            if pending:
                self._drop(sel, pending, _evictee(pending), "evicted to accept others")
            time.sleep(0.01)
            return None
        if len(pending) >= MAX_UNAUTHENTICATED:
            self._drop(sel, pending, _evictee(pending), "evicted: too many handshakes at once")
        sock.setblocking(False)
        pending[sock] = _Handshake(f"{addr[0]}:{addr[1]}", time.monotonic() + HANDSHAKE_DEADLINE)
        sel.register(sock, selectors.EVENT_READ)
        return sock

    def _read_handshake(
        self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], sock: Any, expected: set
    ) -> Optional[Tuple[int, PeerLink]]:
        """(group rank, link) once `sock` sent a valid handshake; None while it has not."""
        h = pending[sock]
        try:
            chunk = sock.recv(_HANDSHAKE.size - len(h.buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            self._drop(sel, pending, sock, f"failed the handshake: {e}")
            return None
        if not chunk:
            self._drop(sel, pending, sock, "closed during the handshake")
            return None
        h.buf += chunk
        if len(h.buf) < _HANDSHAKE.size:
            return None
        token, peer = _HANDSHAKE.unpack(bytes(h.buf))
        if not hmac.compare_digest(token, self.token.encode()) or peer not in expected:
            self._drop(sel, pending, sock, f"wrong token or rank {peer}")
            return None
        sel.unregister(sock)
        del pending[sock]
        try:
            sock.send(_ACCEPTED)  # one byte into an empty buffer: never blocks
        except OSError as e:
            sock.close()
            log.warning("%s: peer rank %d left during the handshake (%s)", self.where, self.ranks[peer], e)
            return None
        expected.discard(peer)
        return peer, PeerLink(sock, self.ranks[peer], self.timeout)

    def _drop(
        self,
        sel: selectors.BaseSelector,
        pending: Dict[socket.socket, _Handshake],
        sock: socket.socket,
        why: Optional[str],
    ) -> None:
        h = pending.pop(sock)
        sel.unregister(sock)
        sock.close()
        if why is not None:
            log.warning("%s: dropped the connection from %s: %s", self.where, h.who, why)


@dataclass
class _Handshake:
    """A connection to the rendezvous listener that has not proven it is a peer yet."""

    who: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


def _evictee(pending: Dict[socket.socket, _Handshake]) -> socket.socket:
    """The oldest connection that sent nothing (a peer sends its handshake with its connect),
    else the oldest."""
    return next((s for s, h in pending.items() if not h.buf), next(iter(pending)))
