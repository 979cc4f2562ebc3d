"""Chunk signals between the ranks of one host through counters in their shared segments.

A socket signal costs a few system calls and, when the peer sleeps in recv, a wake-up (tens of
microseconds in a VM); with a signal per chunk that bounds how small the chunks can be, and
chunks that fit in the L2 cache are what make the staging copies cheap. So inside a collective
(after its first signal, which still goes over the sockets and checks that every rank runs the
same op) each rank bumps a counter at the head of its own segment and watches the peers'.

Only where stores become visible in program order (x86-64's TSO): the data a rank copied into its
slot is then visible before the counter that announces it. Elsewhere `available()` is False and
the transport keeps its socket signals.
"""

from __future__ import annotations

import os
import platform
import select
import time
from typing import Sequence

import numpy as np

from nccl_ddp.comm.host.wire import Header, PeerLink
from nccl_ddp.errors import CommError, CommTimeout

FLAG_BYTES = 64  # one cache line at the head of every segment: the counter, then padding
SPIN_S = 2e-3  # yield-and-recheck this long before sleeping between checks
CROWDED_SPIN_S = 2e-5  # the same with more ranks on this host than cores to run them


def spin_seconds(ranks: int) -> float:
    """How long a wait yields and rechecks before it sleeps: briefly where this host's `ranks`
    outnumber the cores this process may run on (a spinning rank then takes a core from the
    peer it waits for: sleeping hands it over), else long enough to catch a peer's signal
    without a sleep's wake-up latency."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return CROWDED_SPIN_S if ranks > cores else SPIN_S


MAX_NAP_S = 2e-4  # the longest sleep between two checks once spinning is over


def available() -> bool:
    """True where plain stores are seen by other cores in program order (x86 TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Flags:
    """This rank's counter and its peers' (int64 views of each segment's first 8 bytes).

    `signal()` = publish "I reached signal k" and wait until every peer has too: the same
    guarantee as a socket exchange, so slot reuse stays safe. Counters only grow, and every rank
    makes the same sequence of signals (the ops were checked to match over the sockets).
    """

    def __init__(self, counters: Sequence[np.ndarray], rank: int, links: Sequence[PeerLink], timeout: float):
        self.mine = counters[rank]
        self.peers = [(link, c) for link, c in zip(links, (c for j, c in enumerate(counters) if j != rank))]
        self.timeout = timeout
        self.count = int(self.mine[0])
        self.spin_s = spin_seconds(len(counters))

    def signal(self) -> None:
        want = self.post()
        for k in range(len(self.peers)):
            self.wait_for(k, want)

    def post(self) -> int:
        """Publish the next signal without waiting; returns its number (for `ready`/`wait_for`)."""
        self.count += 1
        self.mine[0] = self.count
        return self.count

    def ready(self, k: int, want: int) -> bool:
        """Peer `k` (index into the peers, group-rank order without this rank) reached `want`."""
        return bool(self.peers[k][1][0] >= want)

    def wait_for(self, k: int, want: int) -> None:
        link, c = self.peers[k]
        if c[0] < want:
            self._wait(link, c, want)

    def _wait(self, link: PeerLink, c: np.ndarray, want: int) -> None:
        """Until the peer's counter reaches `want`: yield the core (and the GIL) between checks,
        later sleep; a peer that aborts or hangs up, or the timeout, ends the wait with an error."""
        start = time.perf_counter()
        nap = 1e-5
        while c[0] < want:
            now = time.perf_counter()
            if now - start < self.spin_s:
                os.sched_yield()  # releases the GIL: another thread of this process runs meanwhile
                continue
            if now - start > self.timeout:
                raise CommTimeout(
                    f"peer rank {link.peer} did not reach chunk signal {want} within "
                    f"{self.timeout:.1f}s (is it stuck or dead?)"
                )
            if _peer_wrote(link) and c[0] < want:
                _raise_peers_message(link, want)
            time.sleep(nap)
            nap = min(2 * nap, MAX_NAP_S)


def _peer_wrote(link: PeerLink) -> bool:
    """Something (a message or a hang-up) waits on the socket to the peer."""
    poller = select.poll()
    poller.register(link.sock, select.POLLIN)
    return bool(poller.poll(0))


def _raise_peers_message(link: PeerLink, want: int) -> None:
    """The peer wrote to the socket but has not reached signal `want`: nothing may arrive while it
    is inside the collective with us but its abort or its hang-up (raised with its reason). A
    peer that did reach it may already have sent the next collective's first message (the caller
    checks its counter after the poll: the peer bumps it before it sends)."""
    link.expect(Header(want, 0, 0))  # raises: an abort's reason, a closed link, or a stray message
    raise CommError(f"peer rank {link.peer} sent a message in the middle of a collective")
