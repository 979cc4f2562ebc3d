"""DLPack helpers the framework adapters share: framework tensor <-> native array (NumPy / CuPy).

NumPy and CuPy have no bfloat16 of their own: a bfloat16 tensor crosses as int16 bits and is
reinterpreted as `ml_dtypes.bfloat16` on the NumPy side (no copy either way).
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2


def native_from_dlpack(x: Any, device_type: int) -> Any:
    """A native array sharing memory with `x` (anything with `__dlpack__`): NumPy for CPU memory,
    CuPy for CUDA memory. NumPy's view is read-only when the producer says so (JAX, MindSpore)."""
    if device_type == KDL_CPU:
        return np.from_dlpack(x)
    if device_type == KDL_CUDA:
        import cupy
        return cupy.from_dlpack(x)
    raise TypeError(f"arrays on DLPack device type {device_type} are not supported (CPU or CUDA only)")


def bfloat16_dtype() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


class CapsuleHolder:
    """Gives a bare DLPack capsule the `__dlpack__` protocol (for MindSpore's `to_dlpack`)."""

    def __init__(self, capsule: Any, device: Tuple[int, int] = (KDL_CPU, 0)) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device
