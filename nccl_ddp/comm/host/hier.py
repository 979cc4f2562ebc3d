"""Which transport a host group takes, and the hierarchical one for groups that span nodes.

A group over several nodes (the launcher's: `env.node_rank`) with the same number L >= 2 of ranks
on each, every one able to use shared memory, runs its all-reduce in three stages, so each byte
crosses between nodes about once instead of the flat ring's 2(n-1)/n times per crossing link:

    1. inside each node: all-reduce through shared memory (`ShmTransport`: the node's sum)
    2. across nodes: local rank l all-reduces slice l of it with local rank l of every other node
       (a TCP ring per local rank: every rank drives 1/L of the traffic between nodes)
    3. inside each node: broadcast slice l from local rank l

The summation order is therefore the node sums' (shm's), then the ring's over nodes, not the
flat ring's: every rank gets the same bits, which equal the flat ring's where the sums are exact
(integers, and floats whose partial sums round nowhere). The other ops, and the check that every
rank runs the same op (one header around the flat ring before any data moves), use the flat TCP
ring. NCCL_DDP_HOST_HIERARCHY=0 (on every rank) keeps the flat ring for everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.reduce import Reduction
from nccl_ddp.comm.host.ring import RingTransport
from nccl_ddp.comm.host.shm import ShmTransport, bounds

DEFAULT_CHUNK_BYTES = 2 << 20  # per TCP piece; shm slots default to shm.CHUNK_BYTES


def wanted() -> bool:
    """This rank's NCCL_DDP_HOST_HIERARCHY (sent in the rendezvous: every rank must agree)."""
    return os.environ.get("NCCL_DDP_HOST_HIERARCHY", "1") != "0"


@dataclass(frozen=True)
class Plan:
    """This rank's place: `mates` (the group ranks of its node, in order), `local` (its index
    among them), `node` (its node's index), `column` (local rank `local` of every node)."""

    mates: tuple
    local: int
    node: int
    column: tuple

    def peers(self, rank: int, size: int) -> set:
        n = len(self.column)
        ring = {(rank - 1) % size, (rank + 1) % size}
        return ring | set(self.mates) | {self.column[(self.node - 1) % n], self.column[(self.node + 1) % n]}


def plan(infos: list, nodes: list, rank: int) -> Optional[Plan]:
    """The hierarchy for this group (`nodes`: each rank's node key), or None for the flat ring:
    one node, unequal nodes, a node of one rank, TCP forced or the hierarchy off on any rank."""
    order = list(dict.fromkeys(nodes))
    members = [tuple(r for r, k in enumerate(nodes) if k == key) for key in order]
    if (
        len(order) < 2
        or len({len(m) for m in members}) != 1
        or len(members[0]) < 2
        or any(i["transport"] == "tcp" or not i.get("hier", False) for i in infos)
    ):
        return None
    node = order.index(nodes[rank])
    local = members[node].index(rank)
    return Plan(members[node], local, node, tuple(m[local] for m in members))


def choose(rdv: Any, infos: list, nodes: list, rank: int, size: int, chunk: int, timeout: float) -> tuple:
    """(kind, links, a factory of the transport) for a group over several nodes."""
    p = plan(infos, nodes, rank)
    if p is None:
        links = rdv.connect({(rank - 1) % size, (rank + 1) % size})
        return "tcp", links, lambda: RingTransport(links, rank, size, chunk or DEFAULT_CHUNK_BYTES, timeout)
    links = rdv.connect(p.peers(rank, size))
    return "hier", links, lambda: HierTransport(links, rank, size, p, chunk, timeout)


class HierTransport:
    """The three-stage all-reduce above; every other op on the flat ring."""

    def __init__(self, links: dict, rank: int, size: int, plan: Plan, chunk: int, timeout: float) -> None:
        self.plan, self.timeout = plan, timeout
        ring = {j: links[j] for j in ((rank - 1) % size, (rank + 1) % size)}
        self.flat = RingTransport(ring, rank, size, chunk or DEFAULT_CHUNK_BYTES, timeout)
        self.chunk = self.flat.chunk
        self.intra: Optional[ShmTransport] = None
        self.inter: Optional[RingTransport] = None
        try:
            mates = {j: links[m] for j, m in enumerate(plan.mates) if m != rank}
            self.intra = ShmTransport(mates, plan.local, len(plan.mates), chunk)
            n, k = len(plan.column), plan.node
            across = {j: links[plan.column[j]] for j in ((k - 1) % n, (k + 1) % n)}
            self.inter = RingTransport(across, k, n, chunk or DEFAULT_CHUNK_BYTES, timeout)
        except BaseException:
            self.close()
            raise
        self._stages: dict = {}  # (dtype, op) -> the Reduction of stages 1 and 2

    def _stage(self, red: Reduction) -> Reduction:
        """The stages' reduction: AVG sums (its division comes once, at the end), no prescale
        (applied to the whole buffer first)."""
        op = ReduceOp.SUM if red.op is ReduceOp.AVG else red.op
        key = (red.dtype, op)
        out: Optional[Reduction] = self._stages.get(key)
        if out is None:
            out = self._stages[key] = Reduction(red.dtype, op, red.world, "")
        return out

    def all_reduce(self, buf: np.ndarray, red: Reduction, desc: tuple) -> None:
        assert self.intra is not None and self.inter is not None
        self.flat.agree(desc)  # every rank runs this op (checked around the ring) before data moves
        self.flat.sender.drain(self.timeout)  # (a link may serve the flat ring and the node's shm)
        red.scale_all(buf)
        stage = self._stage(red)
        self.intra.all_reduce(buf, stage, desc)
        n_local, local = len(self.plan.mates), self.plan.local
        a, b = bounds(buf.size, local, n_local)
        self.inter.all_reduce(buf[a:b], stage, desc)
        for j in range(n_local):
            a, b = bounds(buf.size, j, n_local)
            self.intra.broadcast(buf[a:b], j, desc)
        red.finish(buf)

    def broadcast(self, buf: np.ndarray, root: int, desc: tuple) -> None:
        self.flat.broadcast(buf, root, desc)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, desc: tuple) -> None:
        self.flat.all_gather(out, inp, desc)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, red: Reduction, desc: tuple) -> None:
        self.flat.reduce_scatter(out, inp, red, desc)

    def barrier(self, desc: tuple) -> None:
        self.flat.barrier(desc)

    def close(self) -> None:
        closers: list[Callable[[], None]] = [self.flat.close]
        closers += [t.close for t in (self.intra, self.inter) if t is not None]
        for c in closers:
            c()
