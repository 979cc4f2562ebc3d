"""A host group whose buffers someone else's collectives move (`carrier.Carrier`; torch's process
group of any backend, adapters/torch/carried.py). It keeps the host backend's worker thread, stream
order, timeouts, errors and poisoning, and has no store, no rendezvous, no sockets and no shared
memory of its own: the carrier's owner connected the members."""

from __future__ import annotations

from typing import Sequence

from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.comm.host.carrier import Carrier
from nccl_ddp.errors import ConfigError


class CarriedGroup(HostProcessGroup):
    """A host group of group rank `rank` of `size` (global ranks `ranks`) over `carrier`."""

    def __init__(
        self, carrier: Carrier, rank: int, size: int, ranks: Sequence[int], timeout: float, name: str
    ) -> None:
        self._carrier = carrier
        super().__init__(None, rank, size, ranks, timeout, name)

    def _connect(self, transport: str, chunk_bytes: int) -> Carrier:
        self._links = []
        self.transport_kind = self._carrier.kind
        return self._carrier

    def new_subgroup(self, ranks: Sequence[int]) -> None:
        raise ConfigError(
            f"new_group on {self._where}: its collectives are carried by {self.transport_kind}, "
            "which builds its own subgroups: make the subgroup there (torch.distributed."
            "new_group(ranks)) and pass that group instead"
        )
