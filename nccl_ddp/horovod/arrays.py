"""The native arrays Horovod's collectives move: NumPy on the host backend, CuPy on NCCL (CuPy
arrays have NumPy's interface; typed as NumPy's)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from nccl_ddp.comm.group import ProcessGroup

NativeArray = npt.NDArray[Any]


def xp_of(group: ProcessGroup) -> ModuleType:
    """The array module of `group`'s buffers."""
    if group.backend == "host":
        return np
    import cupy

    return cupy


def xp_of_array(a: NativeArray) -> ModuleType:
    """The array module `a` belongs to."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def host(a: NativeArray) -> NativeArray:
    """`a` in host memory (a CuPy array copied)."""
    return a if isinstance(a, np.ndarray) else a.get()


def is_float(a: NativeArray) -> bool:
    return np.dtype(a.dtype).kind in "fc" or np.dtype(a.dtype).name == "bfloat16"
