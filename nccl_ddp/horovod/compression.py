"""Horovod's Compressor interface (horovod/torch/compression.py, horovod/tensorflow/compression.py),
framework-free: a compressor turns a tensor into what a collective sends and back. The fp16 logic
is HalfCompressor's; each framework's FP16Compressor (in its `ops`) names only its float16, its
cast and its is-float test.
"""

from __future__ import annotations

from typing import Protocol, Tuple, TypeVar


class Tensor(Protocol):
    """What a compressor needs of a framework's tensor."""

    @property
    def dtype(self) -> object: ...


T = TypeVar("T", bound=Tensor)


class Compressor:
    """Compresses a tensor before a collective and restores it after (Horovod's interface)."""

    @classmethod
    def compress(cls, tensor: T) -> Tuple[T, object]:
        return tensor, None

    @classmethod
    def decompress(cls, tensor: T, ctx: object) -> T:
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class HalfCompressor(Compressor):
    """Floating-point tensors travel as `half` (float16), and come back in their own dtype. Each
    framework's FP16Compressor supplies `half`, `cast` and `is_float`; the logic is this one."""

    half: object = None

    @staticmethod
    def cast(tensor: T, dtype: object) -> T:
        raise NotImplementedError

    @staticmethod
    def is_float(dtype: object) -> bool:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: T) -> Tuple[T, object]:
        dtype = tensor.dtype
        return (cls.cast(tensor, cls.half) if cls.is_float(dtype) else tensor), dtype

    @classmethod
    def decompress(cls, tensor: T, ctx: object) -> T:
        return cls.cast(tensor, ctx) if ctx is not None and cls.is_float(ctx) else tensor
