"""The launchers of a multi-node job meet in node 0's store once per attempt, before any worker
starts: node ranks (c10d: first come, node 0 = the launcher that hosts the store), each node's
worker count (they must agree), and the attempt number (each attempt's store has its own secret; a
node that restarted first waits for node 0's store of its attempt). During an attempt a node whose
workers failed raises a flag that stops the other nodes' workers, so every node restarts together.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Optional

from nccl_ddp.errors import AuthError, ConfigError, StoreError, StoreTimeout
from nccl_ddp.store.client import TCPStore

log = logging.getLogger("nccl_ddp.launch")

CLIENT_TIMEOUT = 60.0  # the launchers' store requests (they never block long)
POLL = 0.1  # seconds between looks at the store while waiting for other nodes
PROBE_TIMEOUT = 2.0  # seconds for one handshake that asks the store which attempt it serves
CHECK_WAIT = 10.0  # seconds node 0 waits for every node to read the worker counts
EXIT_BARRIER_TIMEOUT = 300.0  # node 0 keeps the store this long for nodes still running (torchrun)


class Stopped(Exception):
    """The launcher got a signal while waiting for other nodes."""


def attempt_secret(secret: str, attempt: int) -> str:
    """The store secret of one attempt: a worker left over from an earlier attempt (on any node)
    cannot join the new store generation."""
    if attempt == 0:
        return secret
    return hashlib.sha256(f"{secret}/restart/{attempt}".encode()).hexdigest()


def _served_attempt(addr: str, port: int, secret: str, attempts: range) -> Optional[int]:
    """Which attempt's secret the store at addr:port accepts (None: none of them)."""
    for attempt in attempts:
        try:
            TCPStore(addr, port, attempt_secret(secret, attempt), timeout=PROBE_TIMEOUT).close()
            return attempt
        except AuthError:
            continue
        except StoreError:
            return None
    return None


def connect(
    addr: str,
    port: int,
    secret: str,
    attempt: int,
    max_restarts: int,
    timeout: float,
    stopped: Callable[[], bool],
) -> tuple:
    """A client of node 0's store for `attempt` (or the later attempt node 0 already runs);
    returns (client, attempt). An earlier attempt's store (node 0 has not restarted yet) is
    waited out until `timeout`."""
    deadline = time.monotonic() + timeout
    served: Optional[int] = None
    while True:
        left = deadline - time.monotonic()
        if stopped():
            raise Stopped
        if left <= 0 and served is None:
            raise StoreTimeout(
                f"could not reach node 0's store at {addr}:{port} for attempt {attempt} within "
                f"{timeout:g}s; start node 0's launcher, check --master-addr/--master-port (or "
                f"--rdzv-endpoint), or raise --rdzv-conf join_timeout"
            )
        if left <= 0:
            raise StoreTimeout(
                f"attempt mismatch: node 0's store at {addr}:{port} still serves attempt {served} "
                f"after {timeout:g}s while this node starts attempt {attempt}; node 0 did not "
                f"restart (see its log), or raise --rdzv-conf join_timeout"
            )
        try:  # short tries, so that a signal is seen within a second
            store = TCPStore(addr, port, attempt_secret(secret, attempt), timeout=min(left, 1.0))
            store.timeout = CLIENT_TIMEOUT
            return store, attempt
        except AuthError:
            pass
        except StoreTimeout:  # nobody listens yet (node 0 between attempts, or starting)
            continue
        served = _served_attempt(addr, port, secret, range(max_restarts + 1))
        if served is None:
            raise AuthError(
                f"node 0's store at {addr}:{port} refused this node's launcher: "
                f"NCCL_DDP_SECRET differs between the nodes; set the same value on "
                f"every node"
            )
        if served > attempt:
            log.warning("node 0 already runs attempt %d; this node joins it (it was at %d)", served, attempt)
            attempt = served
            continue
        log.info("node 0's store still serves attempt %d; waiting for attempt %d", served, attempt)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


class NodeRendezvous:
    """One attempt's meeting of the launchers in node 0's store (keys under `rdzv/`)."""

    def __init__(self, store: TCPStore, nnodes: int, attempt: int):
        self.store, self.nnodes, self.attempt = store, nnodes, attempt

    def join(
        self,
        node_rank: Optional[int],
        nproc: int,
        timeout: float,
        stopped: Callable[[], bool],
        hosting: bool = False,
    ) -> int:
        """Register this node (a rank from the rendezvous when `node_rank` is None), wait for all
        nodes, check that they run the same number of workers; returns this node's rank."""
        s = self.store
        if node_rank is None:
            node_rank = s.add("rdzv/next_node", 1)  # node 0 hosts and never draws
            if node_rank >= self.nnodes:
                raise ConfigError(
                    f"more launchers than --nnodes={self.nnodes} joined the "
                    f"rendezvous (this one would be node {node_rank})"
                )
        if s.add(f"rdzv/claimed/{node_rank}", 1) > 1:
            raise ConfigError(
                f"two launchers claim node rank {node_rank}; give each node its "
                f"own --node-rank (or leave it unset with --rdzv-backend c10d)"
            )
        s.set(f"rdzv/nproc/{node_rank}", str(nproc))
        s.add("rdzv/joined", 1)
        deadline = time.monotonic() + timeout
        while (joined := s.add("rdzv/joined", 0)) < self.nnodes:
            if stopped():
                raise Stopped
            if time.monotonic() > deadline:
                raise StoreTimeout(
                    f"rendezvous (attempt {self.attempt}): {joined} of "
                    f"{self.nnodes} nodes joined within {timeout:g}s; start the "
                    f"launcher on every node (or raise --rdzv-conf join_timeout)"
                )
            time.sleep(POLL)
        counts = [int(s.get(f"rdzv/nproc/{n}", timeout=timeout)) for n in range(self.nnodes)]
        s.add("rdzv/checked", 1)
        deadline = time.monotonic() + CHECK_WAIT  # node 0 keeps the store until all read it
        while (
            hosting
            and s.add("rdzv/checked", 0) < self.nnodes
            and time.monotonic() < deadline
            and not stopped()
        ):
            time.sleep(POLL)
        for other, theirs in enumerate(counts):
            if theirs != nproc:
                raise ConfigError(
                    f"--nproc-per-node differs between nodes: node {other} runs "
                    f"{theirs} worker(s), node {node_rank} (this one) {nproc}; "
                    f"pass the same --nproc-per-node on every node"
                )
        return node_rank

    def failed_elsewhere(self) -> Optional[str]:
        """Why another node ended this attempt, if one did (polled while the workers run)."""
        try:
            reason = self.store.compare_set("rdzv/failed", b"\0", b"\0")
        except StoreError as e:
            return f"lost node 0's store ({e})"
        return reason.decode(errors="replace") if reason else None

    def fail(self, reason: str) -> None:
        """Tell the other nodes this attempt failed here (the first reason wins)."""
        try:
            self.store.compare_set("rdzv/failed", b"", reason.encode())
        except StoreError:
            pass

    def others_finished(self) -> bool:
        """Whether a node already finished this attempt successfully (no restart is possible)."""
        try:
            return self.store.add("rdzv/done", 0) > 0
        except StoreError:
            return False

    def finish(self, hosting: bool, stopped: Callable[[], bool]) -> None:
        """This node's workers succeeded; node 0 keeps the store until every node's did (or one
        failed, or EXIT_BARRIER_TIMEOUT), as torchrun's exit barrier."""
        try:
            self.store.add("rdzv/done", 1)
            deadline = time.monotonic() + EXIT_BARRIER_TIMEOUT
            while hosting and self.store.add("rdzv/done", 0) < self.nnodes:
                if stopped() or time.monotonic() > deadline or self.failed_elsewhere():
                    return
                time.sleep(POLL)
        except StoreError:
            pass

    def close(self) -> None:
        self.store.close()
