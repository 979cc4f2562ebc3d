"""The host group's fused sums (`backend.HostProcessGroup`): a scale, or the fp16 compression's
roundings, applied as the reduction reads each rank's pieces instead of in passes of their own."""

from __future__ import annotations

from typing import Any, Callable, Optional

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.reduce import check_compressed
from nccl_ddp.comm.host.shm import ShmTransport
from nccl_ddp.comm.host.work import HostWork
from nccl_ddp.device import Device, Stream


class FusedSums:
    """`ProcessGroup.fuses_premul_sum` / `fuses_compression` and their all-reduces, over the
    host group's `_all_reduce`."""

    rank: int
    name: str
    _transport: Any
    _all_reduce: Callable[..., HostWork]  # HostProcessGroup's: (buf, op, prescale, stream, tag, wire)

    def fuses_premul_sum(self, device: Device) -> bool:
        """On the host device's (NumPy) buffers: the reduction scales the pieces as it reads them."""
        return device.kind == "host"

    def all_reduce_premul_sum(
        self, buf: Any, factor: float, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> HostWork:
        """On buffers in shared memory (`zeros`) the scale costs no pass of its own: each rank
        scales the pieces it reduces as it reads them; elsewhere each scales its buffer first."""
        return self._all_reduce(buf, ReduceOp.SUM, float(factor), stream, tag)

    def fuses_compression(self, device: Device, compression: str) -> bool:
        """float16 on host buffers over shared memory: `all_reduce_compressed` rounds the float32
        values as it sums them (a TCP ring would carry them at full width)."""
        return (
            device.kind == "host" and compression == "float16" and isinstance(self._transport, ShmTransport)
        )

    def all_reduce_compressed(
        self,
        buf: Any,
        factor: float,
        compression: str,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> HostWork:
        """float32 `buf` = the fp16 compression's result (`reduce.Float16WireSum`: each rank's
        buffer rounded to float16, scaled, rounded again, summed as float16, widened back)."""
        check_compressed(self.rank, self.name, buf, compression, type(self._transport).__name__)
        return self._all_reduce(buf, ReduceOp.SUM, float(factor), stream, tag, "float16")
