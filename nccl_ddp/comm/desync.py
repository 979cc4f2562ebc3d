"""Debug checks that NCCL does not make: `NCCL_DDP_DEBUG=DETAIL` compares every collective across
ranks before it runs, and every NCCL group checks that no two of its ranks share a GPU.

NCCL runs whatever it is given: ranks that call different collectives (or the same one with other
sizes, dtypes or roots) hang or reduce garbage. In DETAIL mode each rank publishes the fingerprint
of its next collective (op, dtype, count, root, reduce op, sequence number, group) in the store and
reads every member's before launching; a difference raises `RankMismatchError` on every rank, a
rank that never arrives `CommTimeout` naming it. Cost: one store set, size - 1 gets and one delete
per collective and rank (README "Failures" has the measurement), so it is off by default, like
TORCH_DISTRIBUTED_DEBUG=DETAIL.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Optional, Sequence

from nccl_ddp.errors import CommTimeout, ConfigError, RankMismatchError, StoreTimeout
from nccl_ddp.job.env import debug_level

_generations: dict = {}  # (name, ranks) -> groups checked so far: fresh keys for each


def _generation(kind: str, name: str, ranks: Sequence[int]) -> int:
    key = (kind, name, tuple(ranks))
    _generations[key] = _generations.get(key, 0) + 1
    return _generations[key]


class DesyncChecker:
    """Compares each collective's fingerprint across the members of one group, through `store`."""

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], name: str, timeout: float) -> None:
        self.store, self.rank, self.ranks = store, rank, tuple(ranks)
        self.name, self.timeout, self.seq = name, timeout, 0
        gen = _generation("desync", name, self.ranks)
        self.prefix = f"nccl_ddp/desync/{name}/{','.join(map(str, self.ranks))}/{gen}"

    @classmethod
    def maybe(
        cls, store: Any, rank: int, ranks: Sequence[int], name: str, timeout: float
    ) -> Optional[DesyncChecker]:
        """A checker when NCCL_DDP_DEBUG=DETAIL (and the group has a store and peers), else None."""
        if debug_level() != "DETAIL" or store is None or len(ranks) < 2:
            return None
        return cls(store, rank, ranks, name, timeout)

    def _key(self, seq: int, r: int) -> str:
        return f"{self.prefix}/{seq}/{r}"

    def check(self, op: str, dtype: Any = None, count: int = 0, root: int = 0, redop: Any = None) -> None:
        """Raise unless every member calls the same collective as this rank's next one."""
        self.seq += 1
        seq = self.seq
        fp = (
            f"{op}(dtype={getattr(dtype, 'name', dtype)}, count={count}, root={root}, "
            f"op={getattr(redop, 'value', redop)})"
        )
        self.store.set(self._key(seq, self.rank), fp)
        others = {}
        for r in range(len(self.ranks)):
            if r == self.rank:
                continue
            try:
                others[r] = self.store.get(self._key(seq, r), timeout=self.timeout).decode()
            except StoreTimeout as e:
                raise CommTimeout(
                    f"rank {self.ranks[self.rank]}: NCCL_DDP_DEBUG=DETAIL: rank {self.ranks[r]} "
                    f"did not reach collective #{seq} of group {self.name!r} within "
                    f"{self.timeout:g}s (this rank calls {fp}); it is stuck, dead, or called "
                    f"fewer collectives"
                ) from e
        if seq > 1:  # everyone published #seq, so everyone has read #seq-1
            self.store.delete(self._key(seq - 1, self.rank))
        differ = {r: v for r, v in others.items() if v != fp}
        if differ:
            r, v = min(differ.items())
            raise RankMismatchError(
                f"rank {self.ranks[self.rank]}: collective #{seq} of group {self.name!r} differs "
                f"across ranks: this rank calls {fp}, rank {self.ranks[r]} calls {v}"
                + (f" ({len(differ) - 1} more rank(s) differ)" if len(differ) > 1 else "")
                + "; every rank must call the same collectives, in the same order, with the same "
                "sizes, dtypes and roots (NCCL would hang or reduce garbage)"
            )


def check_distinct_devices(
    store: Any,
    rank: int,
    ranks: Sequence[int],
    name: str,
    timeout: float,
    device_id: int,
    uuid: Optional[str],
) -> None:
    """ConfigError on every member if two ranks of the group would use the same GPU (same UUID):
    NCCL refuses that with an unhelpful message, or it comes from a CUDA_VISIBLE_DEVICES mistake."""
    if uuid is None or store is None or len(ranks) < 2:
        return
    gen = _generation("devices", name, ranks)
    prefix = f"nccl_ddp/devices/{name}/{','.join(map(str, ranks))}/{gen}"
    mine = {"uuid": uuid, "device": device_id, "host": socket.gethostname()}
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    seen: dict = {}
    for r in range(len(ranks)):
        try:
            info = mine if r == rank else json.loads(store.get(f"{prefix}/{r}", timeout=timeout))
        except StoreTimeout as e:
            raise CommTimeout(
                f"rank {ranks[rank]}: group {name!r}: rank {ranks[r]} did not "
                f"publish its GPU within {timeout:g}s"
            ) from e
        if info["uuid"] in seen:
            first, other = seen[info["uuid"]]
            raise ConfigError(
                f"rank {ranks[rank]}: ranks {ranks[first]} and {ranks[r]} would both use GPU "
                f"{other['device']} (UUID {info['uuid']}) on host {info['host']}; each rank needs "
                f"its own GPU: check CUDA_VISIBLE_DEVICES and that each process selects its "
                f"LOCAL_RANK's device (--nproc-per-node must not exceed the GPUs of a node)"
            )
        seen[info["uuid"]] = (r, info)
