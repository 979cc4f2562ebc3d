"""Which framework an object belongs to, and its adapter module: the one place that decides.

Nothing here imports a framework: the decision is made from the classes' modules, and the adapter
(nccl_ddp/adapters/<name>.py, which does import its framework) is loaded only when needed.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Mapping, Optional

from nccl_ddp.errors import ConfigTypeError

# top-level module of a class in an object's MRO -> adapter module under nccl_ddp.adapters
# (a user's model subclasses the framework's own class, and MindSpore's Parameter lives in "abc")
_ADAPTERS = {"torch": "torch", "mindspore": "mindspore", "jax": "jax", "jaxlib": "jax", "flax": "jax"}

# framework -> (adapter module, class) of the DDP wrapper for its models, which is also one of
# the framework's own module classes (torch.nn.Module, nn.Cell); frameworks not listed use the
# core class
_WRAPPERS = {
    "torch": ("torch_ddp", "TorchDistributedDataParallel"),
    "mindspore": ("mindspore_ddp", "MindSporeDistributedDataParallel"),
}


def framework_of(obj: Any) -> Optional[str]:
    """ "torch", "mindspore" or "jax" for an object of that framework; None for anything else
    (NumPy and CuPy arrays need no adapter)."""
    for cls in type(obj).__mro__:
        name = _ADAPTERS.get(cls.__module__.split(".")[0])
        if name is not None:
            return name
    return None


def is_immutable(x: Any) -> bool:
    """True for arrays that must never be written in place (JAX)."""
    return framework_of(x) == "jax"


def adapter(name: str) -> ModuleType:
    """The adapter module `nccl_ddp.adapters.<name>`, imported now (it imports its framework)."""
    try:
        return importlib.import_module(f"nccl_ddp.adapters.{name}")
    except ImportError as e:
        raise ConfigTypeError(
            f"the nccl_ddp adapter for {name} could not be loaded ({e}); install "
            f"{name}, or pass NumPy / CuPy arrays instead"
        ) from e


def wrapper_class(name: str) -> Any:
    """The DDP wrapper class for models of framework `name` (None: the core class itself)."""
    entry = _WRAPPERS.get(name)
    return None if entry is None else getattr(adapter(entry[0]), entry[1])


def first_leaf(obj: Any) -> Any:
    """The first array-like leaf of a list/tuple/dict (or of any JAX pytree once JAX is in use)."""
    if "jax" in sys.modules:
        return adapter("jax").first_leaf(obj)
    while isinstance(obj, (list, tuple, Mapping)) and framework_of(obj) is None:
        if not obj:
            return None
        obj = next(iter(obj.values())) if isinstance(obj, Mapping) else obj[0]
    return obj


def framework_of_leaves(obj: Any) -> Optional[str]:
    """The framework of an array or of a structure's first leaf; None for NumPy / CuPy."""
    return framework_of(obj) or framework_of(first_leaf(obj))


def grads_adapter(obj: Any) -> Any:
    """The `GradsAdapter` for a framework's parameters or grads (or a structure of them); None
    for NumPy / CuPy arrays."""
    name = framework_of_leaves(obj)
    return None if name is None else adapter(name).grads_adapter()


def module_adapter(module: Any) -> Any:
    """The `GradModule` that `DistributedDataParallel` drives for `module`: an `ArrayModule` for
    a list/tuple/dict of NumPy/CuPy arrays, else the adapter of the module's framework."""
    if isinstance(module, (list, tuple, dict)):
        return adapter("arrays").ArrayModule(module)
    name = framework_of(module)
    if name is None:
        raise ConfigTypeError(
            f"module must be a model of a supported framework (torch.nn.Module, MindSpore nn.Cell), "
            f"an nccl_ddp ArrayModule or a list/dict of NumPy/CuPy arrays, got "
            f"{type(module).__module__}.{type(module).__name__}"
        )
    return adapter(name).adapt(module)
