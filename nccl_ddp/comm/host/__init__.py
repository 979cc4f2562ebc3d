"""The host backend: NumPy collectives between processes over /dev/shm (one host) or a pipelined
TCP ring (across hosts), each group's work in order on one worker thread."""

from nccl_ddp.comm.host.backend import HostProcessGroup, HostWork

__all__ = ["HostProcessGroup", "HostWork"]
