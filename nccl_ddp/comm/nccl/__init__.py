"""The NCCL backend: CuPy's NCCL bindings on a dedicated comm stream, a watchdog for errors and
timeouts. CuPy is imported on first use."""

from nccl_ddp.comm.nccl.backend import NcclProcessGroup, NcclWork
from nccl_ddp.comm.nccl.runtime import is_available

__all__ = ["NcclProcessGroup", "NcclWork", "is_available"]
