"""torch tensors <-> native arrays (NumPy on the CPU, CuPy on CUDA) through DLPack, without
copies, and torch's current CUDA stream as CuPy's: what every torch adapter module (the DDP
module, the grad reducer's lists, ZeRO's shards, comm hooks, the Horovod facade) converts with.
NumPy's DLPack knows no bfloat16: CPU bfloat16 tensors cross as int16 and are viewed back.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from nccl_ddp.arrays.dlpack import KDL_CPU, KDL_CUDA, bfloat16_dtype, is_bfloat16, native_from_dlpack
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.errors import ConfigTypeError

if TYPE_CHECKING:
    import torch


def to_native(t: torch.Tensor) -> NativeArray:
    """A NumPy (CPU) or CuPy (CUDA) array sharing memory with tensor `t` (writable)."""
    import torch

    t = t.detach()
    kind = {"cpu": KDL_CPU, "cuda": KDL_CUDA}.get(t.device.type)
    if kind is None:
        raise ConfigTypeError(f"tensors on {t.device} are not supported; use CPU or CUDA tensors")
    if t.dtype == torch.bfloat16 and kind == KDL_CPU:  # NumPy's DLPack knows no bfloat16
        return native_from_dlpack(t.view(torch.int16), kind).view(bfloat16_dtype())
    return native_from_dlpack(t, kind)  # CuPy 14 reads bfloat16 as ml_dtypes.bfloat16


def from_native(a: NativeArray) -> torch.Tensor:
    """A tensor sharing memory with the native array `a`."""
    import numpy as np
    import torch

    if isinstance(a, np.ndarray) and is_bfloat16(a.dtype):
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def is_cuda(t: torch.Tensor) -> bool:
    """Whether tensor `t` lives on a CUDA device."""
    return t.device.type == "cuda"


@contextlib.contextmanager
def torch_stream_current(on_cuda: bool) -> Iterator[None]:
    """Make torch's current CUDA stream CuPy's current stream, so the reducer's compute stream is
    the one backward runs on; a no-op on the CPU."""
    if not on_cuda:
        yield
        return
    import cupy
    import torch

    from nccl_ddp.device import RawStream

    stream = torch.cuda.current_stream()
    # Stream.from_external: CuPy 14 deprecates ExternalStream (a DeprecationWarning per call);
    # the raw pointer works whether or not this torch has __cuda_stream__
    with cupy.cuda.Device(stream.device.index), cupy.cuda.Stream.from_external(RawStream(stream.cuda_stream)):
        yield
