"""A tiny framework that speaks DLPack and nothing else, for testing nccl_ddp's generic adapter
without TensorFlow or Paddle: `fakefw.Tensor` wraps a NumPy array behind `__dlpack__` /
`__dlpack_device__`, its dtypes are objects of its own (`fakefw.float32`, shown like Paddle's
`DataType.FLOAT32`), and the module keeps `from_dlpack` where Paddle does (`utils.dlpack`).

Two more fake frameworks for the refusals: `nofromfw.Tensor` has `__dlpack__` but its module no
`from_dlpack`, and `nodlpackfw.Tensor` only `.numpy()` (like tinygrad).
"""

from __future__ import annotations

import sys
import types

import numpy as np


class DType:
    """A framework's own dtype object: not a NumPy dtype (np.dtype(fakefw.float32) fails)."""

    def __init__(self, name: str) -> None:
        self.name = name.upper()

    def __repr__(self) -> str:
        return f"fakefw.{self.name.lower()}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


float16, float32, float64 = DType("float16"), DType("float32"), DType("float64")


class Tensor:
    """An array of fakefw: a NumPy array reached only through DLPack (or `.numpy()`, a copy)."""

    def __init__(self, data, read_only: bool = False, name=None) -> None:
        self._a = np.ascontiguousarray(data)
        if read_only:
            self._a = self._a.copy()
            self._a.flags.writeable = False
        self.name = name

    @property
    def shape(self):
        return self._a.shape

    @property
    def dtype(self) -> DType:
        return DType(self._a.dtype.name)

    def __dlpack__(self, stream=None, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def numpy(self) -> np.ndarray:
        return self._a.copy()


def _from_dlpack(x) -> Tensor:
    """Zero-copy: the new Tensor wraps the producer's memory."""
    calls["from_dlpack"] += 1
    return Tensor(np.from_dlpack(x))


utils = types.SimpleNamespace(dlpack=types.SimpleNamespace(from_dlpack=_from_dlpack))
calls = {"from_dlpack": 0}


class _NoFrom(Tensor):
    pass


class _NoDLPack:
    def __init__(self, data) -> None:
        self._a = np.asarray(data)
        self.shape, self.dtype = self._a.shape, DType(self._a.dtype.name)

    def numpy(self) -> np.ndarray:
        return self._a.copy()


def _module(name: str, cls: type) -> type:
    """`cls` as `<name>.Tensor`, in a module of that name with nothing else in it."""
    mod = types.ModuleType(name)
    sub = type("Tensor", (cls,), {"__module__": name})
    mod.Tensor = sub
    sys.modules[name] = mod
    return sub


NoFromTensor = _module("nofromfw", _NoFrom)
NoDLPackTensor = _module("nodlpackfw", _NoDLPack)
