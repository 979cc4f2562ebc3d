"""What a host group needs of a transport that someone else's collectives make (`carried.py`'s
`CarriedGroup`; an adapter's, e.g. torch's process group of any backend, adapters/torch/carried.py).

Each carrier call runs on the group's worker thread, one at a time, in the same order on every
rank, and returns once its collective is done here (or raises). `red` is the host backend's
reduction: the carrier applies its pre-scale (`red.scale_all`) and AVG's division (`red.finish`)
around a sum, so every op means what it means on the host backend; `desc` is the op's (kind,
dtype, op, root, size), for carriers that check agreement.
"""

from __future__ import annotations

from typing import Any, Protocol

from nccl_ddp.comm.host.reduce import Reduction


class Carrier(Protocol):
    kind: str  # for messages and `transport_kind`: "torch:threaded", ...

    def all_reduce(self, buf: Any, red: Reduction, desc: tuple) -> None: ...

    def broadcast(self, buf: Any, root: int, desc: tuple) -> None: ...

    def all_gather(self, out: Any, inp: Any, desc: tuple) -> None: ...

    def reduce_scatter(self, out: Any, inp: Any, red: Reduction, desc: tuple) -> None: ...

    def barrier(self, desc: tuple) -> None: ...

    def close(self) -> None:
        """Release what the carrier holds (never its owner's group). Idempotent."""
