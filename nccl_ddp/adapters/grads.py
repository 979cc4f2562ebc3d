"""`DistributedGradReducer` over a framework's own objects: pick the adapter from the type of the
first parameter / grad, describe the parameters in native terms, convert grads in and out.

A framework adapter module (adapters/torch.py, jax.py, mindspore.py) provides `grads_adapter()`
returning a `GradsAdapter`. NumPy / CuPy lists need no adapter (`for_objects` returns None).
"""
from __future__ import annotations

import abc
import importlib
import sys
from typing import Any, Callable, List, Optional

import numpy as np
from nccl_ddp.errors import ConfigTypeError

# top-level module of a leaf's type -> adapter module under nccl_ddp.adapters
_FRAMEWORKS = {"torch": "torch", "mindspore": "mindspore", "jax": "jax", "jaxlib": "jax"}


class ParamInfo:
    """What the reducer needs to know about one parameter: shape, NumPy dtype, name and, when the
    parameter has one, its `comm_fusion` id (grads with different ids never share a bucket)."""

    def __init__(self, shape: tuple, dtype: np.dtype, name: Optional[str] = None,
                 comm_fusion: Optional[int] = None) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.name = name
        if comm_fusion is not None:
            self.comm_fusion = comm_fusion

    def __repr__(self) -> str:
        return f"ParamInfo({self.name!r}, {self.shape}, {self.dtype})"


class GradsAdapter(abc.ABC):
    """Converts one framework's parameters and grads for `DistributedGradReducer`."""

    @abc.abstractmethod
    def param_infos(self, parameters: Any) -> List[ParamInfo]:
        """One `ParamInfo` per parameter, in the order `to_native` lists the grads."""

    @abc.abstractmethod
    def to_native(self, grads: Any) -> List[Any]:
        """The grads as native arrays (zero-copy DLPack views where the framework allows)."""

    @abc.abstractmethod
    def from_native(self, grads: Any, reduced: List[Any]) -> Any:
        """`reduced` (native arrays) as the framework's grads, in the structure of `grads`."""

    def reduce(self, reduce_native: Callable[[List[Any]], List[Any]], grads: Any) -> Any:
        """Run `reduce_native` (the reducer on a native list) on `grads`; the frameworks whose
        compute stream is not CuPy's current one override this to make it current."""
        return self.from_native(grads, reduce_native(self.to_native(grads)))


def first_leaf(obj: Any) -> Any:
    """The first array-like leaf of a list/tuple/dict (or any JAX pytree once JAX is imported)."""
    if "jax" in sys.modules:
        import jax
        leaves = jax.tree_util.tree_leaves(obj)
        return leaves[0] if leaves else None
    while True:
        if isinstance(obj, (list, tuple)) and not _framework_of(obj):
            if not obj:
                return None
            obj = obj[0]
        elif isinstance(obj, dict):
            if not obj:
                return None
            obj = next(iter(obj.values()))
        else:
            return obj


def _framework_of(obj: Any) -> Optional[str]:
    """By the classes of `obj` (MindSpore's Parameter class lives in module "abc")."""
    for cls in type(obj).__mro__:
        framework = _FRAMEWORKS.get(cls.__module__.split(".")[0])
        if framework is not None:
            return framework
    return None


def for_objects(obj: Any) -> Optional[GradsAdapter]:
    """The adapter for a framework's parameters or grads; None for NumPy / CuPy arrays."""
    framework = _framework_of(obj) or _framework_of(first_leaf(obj))
    if framework is None:
        return None
    try:
        module = importlib.import_module(f"nccl_ddp.adapters.{framework}")
    except ImportError as e:
        raise ConfigTypeError(f"no nccl_ddp adapter for {framework} could be loaded ({e}); pass NumPy / "
                        "CuPy arrays instead") from e
    return module.grads_adapter()


def materialize(parameters: Any) -> Any:
    """A list for a one-shot iterable of parameters (torch's `model.parameters()` generator)."""
    if isinstance(parameters, (list, tuple, dict)) or hasattr(parameters, "shape"):
        return parameters
    if hasattr(parameters, "__iter__") and hasattr(parameters, "__next__"):
        return list(parameters)
    return parameters
