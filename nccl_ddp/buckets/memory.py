"""Bucket memory: one flat, zero-filled device buffer per bucket, and views of it per parameter.

Owns the allocation and the grad views (Megatron's `_ParamAndGradBuffer` / bucket views); when a
bucket is reduced is decided by `reducer.py`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from nccl_ddp.buckets.layout import BucketLayout
from nccl_ddp.device.base import Device, Stream
from nccl_ddp.errors import ReducerError


class BucketBuffers:
    """`buffers[b]` has `layout.buckets[b].padded` elements of the bucket's dtype, from `zeros`
    (the group's: shared memory on the host's shm transport) or else `device.zeros`."""

    def __init__(
        self, layout: BucketLayout, device: Device, zeros: Optional[Callable[[int, Any], Any]] = None
    ) -> None:
        self.layout = layout
        alloc = zeros or device.zeros
        self.buffers: List[Any] = [alloc(b.padded, b.dtype) for b in layout.buckets]

    def view(self, param: int, shape: Sequence[int]) -> Any:
        """The slice of the bucket that holds `param`, shaped like the parameter (no copy)."""
        where = self.layout.locate(param)
        if where is None:
            raise ReducerError(f"parameter {param} is in no bucket (excluded by static_graph)")
        b, slot = where
        bucket = self.layout.buckets[b]
        start = bucket.offsets[slot]
        return self.buffers[b][start : start + bucket.numels[slot]].reshape(tuple(shape))

    def adopt_grads(
        self, grads: List[Any], shapes: Sequence[tuple], install: Callable[[int, Any], None], stream: Stream
    ) -> None:
        """The views: copy each bucketed grad into its slice (in `stream` order), then make
        `grads[i]` and, through `install(i, view)`, the framework's grad that slice."""
        views = {}
        for b in self.layout.buckets:
            for p in b.params:
                views[p] = self.view(p, shapes[p])
                stream.submit(copy_into, views[p], grads[p])
        for p, v in views.items():
            install(p, v)
            grads[p] = v

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


def accumulate_into(dst: Any, src: Any) -> None:
    """dst += src (a framework's grad for a parameter, any shape of the same size)."""
    dst += src.reshape(dst.shape)


def copy_of(device: Device, stream: Stream, x: Any) -> Any:
    """A new array holding `x`'s values once `stream` gets there."""
    out = device.xp.empty_like(x)
    stream.submit(copy_into, out, x)
    return out
