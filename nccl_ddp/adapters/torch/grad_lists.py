"""`DistributedGradReducer`'s adapter for torch: parameters are tensors (`model.parameters()`
works), grads a list or tuple of tensors, crossing to the reducer as native arrays through DLPack
(adapters/torch/tensors.py) on torch's current CUDA stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List, Sequence, Tuple, Union

from nccl_ddp.adapters.torch.tensors import from_native, is_cuda, to_native, torch_stream_current
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.interfaces import GradsAdapter, ReduceNative
from nccl_ddp.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import torch


Tensors = Union[List["torch.Tensor"], Tuple["torch.Tensor", ...]]
"""The grads as given: a list or tuple of tensors (handed back the same way)."""


class TorchGrads(GradsAdapter):
    """Parameters: tensors (`model.parameters()` works); grads: a list/tuple of tensors. The
    reduced grads are new tensors viewing the reducer's fresh bucket memory (no copy out)."""

    def param_infos(self, parameters: Iterable[torch.Tensor]) -> List[ParamSpec]:
        import torch

        return [ParamSpec(tuple(p.shape), to_native(torch.empty(0, dtype=p.dtype)).dtype) for p in parameters]

    def to_native(self, grads: Tensors) -> List[NativeArray]:
        self._check(grads)
        return [to_native(g if g.is_contiguous() else g.contiguous()) for g in grads]

    def from_native(self, grads: Tensors, reduced: Sequence[NativeArray]) -> Tensors:
        return type(grads)(from_native(a) for a in reduced)

    def reduce(self, reduce_native: ReduceNative, grads: Tensors) -> Tensors:
        self._check(grads)
        with torch_stream_current(bool(grads) and is_cuda(grads[0])):
            return super().reduce(reduce_native, grads)

    @staticmethod
    def _check(grads: object) -> None:
        if not isinstance(grads, (list, tuple)):
            raise ConfigTypeError(f"grads must be a list or tuple of tensors, got {type(grads).__name__}")
        import torch

        for i, g in enumerate(grads):
            if g is None:
                raise ConfigError(
                    f"grads[{i}] is None (that parameter got no grad); pass "
                    "torch.zeros_like(param) for it so every rank reduces the same list"
                )
            if not isinstance(g, torch.Tensor):
                raise frameworks.mixed_frameworks(
                    f"grads[{i}]", g, "torch", "torch tensors (torch.from_dlpack)"
                )
