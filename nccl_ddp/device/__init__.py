"""Devices: `host` (NumPy + worker-thread streams) and `cuda` (CuPy), behind one interface."""

from __future__ import annotations

from typing import Optional

from nccl_ddp.device.base import Device, Event, Stream
from nccl_ddp.device.cuda import CudaDevice, CudaEvent, CudaStream, RawStream, cuda_available
from nccl_ddp.device.host import HostDevice, HostEvent, HostStream, ImmediateStream, aligned_empty
from nccl_ddp.errors import ConfigError
from nccl_ddp.job.env import DEFAULT_TIMEOUT

__all__ = [
    "DEFAULT_TIMEOUT",
    "Device",
    "Event",
    "Stream",
    "CudaDevice",
    "CudaEvent",
    "CudaStream",
    "RawStream",
    "cuda_available",
    "HostDevice",
    "HostEvent",
    "HostStream",
    "ImmediateStream",
    "aligned_empty",
    "get_device",
]


def get_device(kind: Optional[str] = None, local_rank: Optional[int] = None) -> Device:
    """ "host" -> HostDevice; "cuda" -> CudaDevice; None -> cuda when CuPy sees a GPU, else host.
    The GPU is `local_rank` (or GPU 0 when each process sees one), CuPy's current one if None."""
    if kind is None:
        kind = "cuda" if cuda_available() else "host"
    if kind == "host":
        return HostDevice()
    if kind != "cuda":
        raise ConfigError(f"unknown device kind {kind!r}; use 'cuda', 'host' or None")
    if not cuda_available():
        raise ConfigError(
            "device 'cuda' asked for, but CuPy is missing or sees no GPU; install "
            "nccl_ddp[cuda12] on a GPU machine or use the host device"
        )
    from nccl_ddp.device.cuda import _cupy

    cp = _cupy()
    if local_rank is None:
        return CudaDevice(cp.cuda.Device().id)
    n = cp.cuda.runtime.getDeviceCount()
    if local_rank >= n and n == 1:
        local_rank = 0  # one GPU per process (CUDA_VISIBLE_DEVICES set per rank)
    return CudaDevice(local_rank)
