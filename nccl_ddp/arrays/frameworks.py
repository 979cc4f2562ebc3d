"""Which framework an object belongs to, and its adapter: the one place that decides.

Nothing here imports a framework: the decision is made from the classes' modules, and the adapter
(nccl_ddp/adapters/<name>/adapter.py, which does import its framework) is loaded only when needed.

`ADAPTERS` is the whole table: ours, and those a third party adds with `register` (an adapter
in its own package). A framework that is not in it but whose arrays speak DLPack (`__dlpack__`)
goes through the generic adapter (`nccl_ddp.adapters.generic`), which finds the framework's own
`from_dlpack`; NumPy and CuPy arrays are the backends' own and need no adapter.

What this layer asks of an adapter is `ArrayAdapter`; the DDP core asks more of the same modules
(`nccl_ddp.ddp.interfaces.FrameworkAdapter`), and each adapter module declares itself one, so
mypy checks every member where the adapter is written.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Protocol, Tuple, Union

import numpy as np

from nccl_ddp.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import cupy

NativeArray = Union[np.ndarray, "cupy.ndarray"]
"""The backends' own arrays (NumPy on "host", CuPy on "cuda"): what crosses into the core."""


class ArrayAdapter(Protocol):
    """What the layers below the DDP core ask of a framework's adapter: its arrays in and out."""

    def array_from_native(self, native: NativeArray, like: object = None) -> object:
        """What a collective returns to a caller of this framework for the native result: a new
        array of the framework over `native` (or `like` updated, for a framework's variable)."""
        ...

    def dlpack_source(self, x: object) -> Optional[object]:
        """What DLPack reads for an object of this framework without `__dlpack__` (TensorFlow's
        variables: their value), or None when the framework has no such export."""
        ...


class PytreeAdapter(ArrayAdapter, Protocol):
    """An adapter whose framework nests arrays in structures of its own (JAX's pytrees)."""

    def first_leaf(self, obj: object) -> object:
        """The first array leaf of any of the framework's structures (None for an empty one)."""
        ...


OURS = "nccl_ddp.adapters"  # the package of the adapters nccl_ddp ships


@dataclass(frozen=True)
class Framework:
    """One row of the table: a framework with its own adapter module."""

    name: str  # how messages name it, and the key of the adapter it shares (jaxlib -> jax)
    adapter: str  # module under `package` (imports the framework itself)
    immutable: bool = False  # its arrays are never written in place: a new array comes back
    wrapper: Optional[Tuple[str, str]] = None  # (adapter module, class) of its models' DDP wrapper
    # libraries built on the framework that its adapter package integrates (imported only there)
    integrations: Tuple[str, ...] = ()
    package: str = OURS  # where `adapter` and the wrapper's module live (a third party's own)


_TORCH = Framework(
    "torch",
    "torch.adapter",
    wrapper=("torch.ddp", "TorchDistributedDataParallel"),
    integrations=("lightning", "pytorch_lightning", "accelerate", "transformers"),
)
_MS_DDP = ("mindspore.ddp", "MindSporeDistributedDataParallel")
_MINDSPORE = Framework("mindspore", "mindspore.adapter", wrapper=_MS_DDP)
_JAX = Framework("jax", "jax.adapter", immutable=True)
_TENSORFLOW = Framework("tensorflow", "tensorflow.adapter", immutable=True)
_KERAS = Framework("keras", "keras.adapter")  # Keras 3 variables; their grads are the backend's tensors
_PADDLE = Framework("paddle", "paddle.adapter", wrapper=("paddle.ddp", "PaddleDistributedDataParallel"))

# top-level module of a class in an object's MRO -> its framework (a user's model subclasses the
# framework's own class, and MindSpore's Parameter lives in "abc"); the whole list of adapters
_TABLE: Dict[str, Framework] = {
    "torch": _TORCH,
    "mindspore": _MINDSPORE,
    "jax": _JAX,
    "jaxlib": _JAX,
    "flax": _JAX,
    "tensorflow": _TENSORFLOW,
    "tf_keras": _TENSORFLOW,  # Keras 2: TensorFlow variables and tensors
    "keras": _KERAS,
    "paddle": _PADDLE,
}
ADAPTERS: Mapping[str, Framework] = MappingProxyType(_TABLE)  # (read-only: `register` adds)

NATIVE = ("numpy", "cupy")  # the backends' own arrays: no adapter
GENERIC = "generic"  # the adapter module for any other framework whose arrays speak DLPack


def register(top_module: str, framework: Framework) -> None:
    """Add a framework whose adapter lives in a third party's package (`framework.package`): the
    objects whose classes come from the top-level module `top_module` go to it from now on, in
    this process (each rank registers it, before wrapping a model). Its adapter module implements
    `nccl_ddp.ddp.interfaces.FrameworkAdapter`, as ours do (docs/architecture.md)."""
    if not isinstance(framework, Framework):
        raise ConfigTypeError(
            f"framework must be an nccl_ddp.frameworks.Framework, got {type(framework).__name__}"
        )
    taken = _TABLE.get(top_module)
    if taken is not None or top_module in NATIVE or top_module in ("builtins", "nccl_ddp"):
        whose = f"the {taken.name} adapter's" if taken is not None else "not a framework's"
        raise ConfigError(f"cannot register an adapter for {top_module!r}: that module is {whose}")
    if framework.package == OURS:
        raise ConfigError(
            f"Framework({framework.name!r}, ...).package is {OURS!r}, whose adapters ship with "
            f"nccl_ddp: pass package= the package of your adapter module ({framework.adapter!r})"
        )
    _TABLE[top_module] = framework


def framework_of(obj: Any) -> Optional[str]:
    """The framework of an array, parameter or model: a name of `ADAPTERS` ("torch", "jax", ...),
    the top-level module of any other array-like object ("tinygrad", "mxnet": the generic
    adapter's), or None for NumPy / CuPy arrays and for anything that is no array (a list)."""
    for cls in type(obj).__mro__:
        base = cls.__module__.split(".")[0]
        entry = ADAPTERS.get(base)
        if entry is not None:
            return entry.name
        if base in NATIVE:  # a NumPy / CuPy array, or a subclass of one
            return None
    root = type(obj).__module__.split(".")[0]
    if root in ("builtins", "nccl_ddp"):
        return None
    if hasattr(obj, "__dlpack__") or (hasattr(obj, "shape") and hasattr(obj, "dtype")):
        return root
    return None


_SHOWN = {
    "jax": "JAX",
    "mindspore": "MindSpore",
    "numpy": "NumPy",
    "cupy": "CuPy",
    "tensorflow": "TensorFlow",
}


def shown(framework: str) -> str:
    """How a message names a framework (its module's name when we have no nicer one)."""
    return _SHOWN.get(framework, framework)


def mixed_frameworks(what: str, x: Any, built_on: str, pass_instead: str, why: str = "") -> ConfigTypeError:
    """The one refusal of an array of another framework than the reducer's parameters: names
    `what` (a grad, by index or name), its type and framework, the reducer's framework
    (`built_on`, plus `why` it cannot take others), and what to pass instead."""
    theirs = shown(framework_of(x) or type(x).__module__.split(".")[0])
    return ConfigTypeError(
        f"{what} is a {type(x).__module__}.{type(x).__name__} ({theirs}), but this reducer was "
        f"built on {shown(built_on)} parameters{why}: pass {pass_instead}, or build the reducer on "
        f"{theirs} parameters; nccl_ddp never mixes frameworks"
    )


def is_immutable(x: Any) -> bool:
    """True for arrays that must never be written in place (JAX, TensorFlow tensors)."""
    name = framework_of(x)
    entry = None if name is None else ADAPTERS.get(name)
    return entry is not None and entry.immutable


def adapter(name: str) -> ArrayAdapter:
    """The adapter of framework `name`, imported now (it imports its framework): the module
    `nccl_ddp.adapters.<adapter>` for a framework of `ADAPTERS`, else `generic_adapter(name)`.
    The DDP core sees the same object as a `FrameworkAdapter` (`ddp.interfaces.adapter_of`)."""
    entry = ADAPTERS.get(name)
    return _load(entry.adapter, name, entry.package) if entry is not None else generic_adapter(name)


def generic_adapter(name: str) -> ArrayAdapter:
    """The generic DLPack adapter (`nccl_ddp.adapters.generic.GenericAdapter`) for framework `name`."""
    return _load(GENERIC, name).GenericAdapter(name)


def adapter_module(module: str, name: str) -> Any:
    """The module `nccl_ddp.adapters.<module>` of framework `name` itself, imported now (glue that
    is no array adapter, e.g. torch.dist, which the functional API asks when torch is loaded)."""
    return _load(module, name)


def wrapper_class(name: str) -> Any:
    """The DDP wrapper class for models of framework `name` (None: the core class itself)."""
    entry = ADAPTERS.get(name)
    if entry is None or entry.wrapper is None:
        return None
    return getattr(_load(entry.wrapper[0], name, entry.package), entry.wrapper[1])


def _load(module: str, name: str, package: str = OURS) -> Any:
    """The module `<package>.<module>` (`nccl_ddp.adapters.<module>` for ours; typed where it
    is used: each adapter module declares the Protocol it implements, which mypy checks there)."""
    try:
        return importlib.import_module(f"{package}.{module}")
    except ImportError as e:
        raise ConfigTypeError(
            f"the nccl_ddp adapter for {name} could not be loaded ({e}); install "
            f"{name}, or pass NumPy / CuPy arrays instead"
        ) from e


def first_leaf(obj: Any) -> Any:
    """The first array-like leaf of a list/tuple/dict (or of any JAX pytree once JAX is in use)."""
    if "jax" in sys.modules:
        pytrees: PytreeAdapter = _load(ADAPTERS["jax"].adapter, "jax")
        return pytrees.first_leaf(obj)
    while isinstance(obj, (list, tuple, Mapping)) and framework_of(obj) is None:
        if not obj:
            return None
        obj = next(iter(obj.values())) if isinstance(obj, Mapping) else obj[0]
    return obj


def framework_of_leaves(obj: Any) -> Optional[str]:
    """The framework of an array or of a structure's first leaf; None for NumPy / CuPy."""
    return framework_of(obj) or framework_of(first_leaf(obj))
