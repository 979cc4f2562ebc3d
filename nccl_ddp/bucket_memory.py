"""Bucket memory: one flat, zero-filled device buffer per bucket, and views of it per parameter.

Owns the allocation only (Megatron's `_ParamAndGradBuffer`); which grads live in it and when it
is reduced is decided by `reducer.py`.
"""
from __future__ import annotations

from typing import Any, List, Sequence

from .buckets import BucketLayout


class BucketBuffers:
    """`buffers[b]` has `layout.buckets[b].padded` elements of the bucket's dtype."""

    def __init__(self, layout: BucketLayout, device) -> None:
        self.layout = layout
        self.buffers: List[Any] = [device.zeros(b.padded, b.dtype) for b in layout.buckets]

    def view(self, param: int, shape: Sequence[int]) -> Any:
        """The slice of the bucket that holds `param`, shaped like the parameter (no copy)."""
        b, slot = self.layout.locate(param)
        bucket = self.layout.buckets[b]
        start = bucket.offsets[slot]
        return self.buffers[b][start:start + bucket.numels[slot]].reshape(tuple(shape))

    def offsets(self, b: int) -> list:
        return list(self.layout.buckets[b].offsets)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.layout.buckets)


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src (reshaped to dst); a no-op when they are the same array."""
    if dst is not src:
        dst[...] = src.reshape(dst.shape)


def to_host(x: Any) -> Any:
    """A NumPy array of `x` (CuPy: copied to the host, which waits for its stream)."""
    get = getattr(x, "get", None)
    return get() if get is not None else x
