"""The generic DLPack adapter: any framework whose arrays have `__dlpack__` and whose module has a
`from_dlpack` (PaddlePaddle, TensorFlow's `experimental.dlpack`, any array library that follows the
Python array API) works in the functional collectives, `DistributedGradReducer` and the array form
of `DistributedDataParallel` without an adapter of its own.

In: a grad is read through DLPack without a copy (NumPy on the CPU, CuPy on the GPU; a read-only
view when the producer says so). Out: each reduced grad is a fresh bucket slice handed to the
framework's `from_dlpack`, which keeps it without a copy where the framework can (the host backend
aligns every slice to 64 bytes). Dtypes come from the framework's own dtype objects
(`nccl_ddp.arrays.dlpack.numpy_dtype`), never assumed to be NumPy's.

Framework adapters with more to do (TensorFlow's variables and graphs) subclass `DLPackGrads` and
hand a `GenericAdapter` the places to look for `from_dlpack`.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional, Sequence

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import cannot_exchange, native_view, numpy_dtype
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradsAdapter
from nccl_ddp.errors import ConfigError, ConfigTypeError

FromDLPack = Callable[[object], object]
"""A framework's `from_dlpack`: an array (or a capsule) in, the framework's array out."""

# where a framework's module keeps from_dlpack, in the order tried (attribute paths)
FROM_DLPACK_PATHS = (
    "from_dlpack",
    "experimental.dlpack.from_dlpack",
    "utils.dlpack.from_dlpack",
    "dlpack.from_dlpack",
)


class GenericAdapter:
    """A framework reached through DLPack only, by its top-level module's name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._from_dlpack: Optional[FromDLPack] = None

    def module(self) -> ModuleType:
        """The framework's top-level module (already imported when one of its arrays exists)."""
        if self.name in sys.modules:
            return sys.modules[self.name]
        try:
            return importlib.import_module(self.name)
        except ImportError as e:
            raise ConfigTypeError(f"cannot import the framework {self.name!r} ({e})") from e

    def from_dlpack(self) -> FromDLPack:
        """The framework's `from_dlpack`, found once at the first of `FROM_DLPACK_PATHS`."""
        if self._from_dlpack is None:
            self._from_dlpack = find_from_dlpack(self.module(), self.name)
        return self._from_dlpack

    def array_from_native(self, native: NativeArray, like: object = None) -> object:
        """A new array of this framework over `native` (zero-copy where the framework can)."""
        make = self.from_dlpack()
        try:
            return make(native)
        except (TypeError, AttributeError):  # an older from_dlpack that takes capsules only
            return make(native.__dlpack__())

    def dlpack_source(self, x: object) -> None:
        """None: the generic path is for arrays that speak `__dlpack__`."""
        return None

    def to_native(self, x: object) -> NativeArray:
        """A native view of one of the framework's arrays, through DLPack (never a copy)."""
        return native_view(x, f"a {self.name} array")

    def from_native(self, native: NativeArray) -> object:
        return self.array_from_native(native)

    def grads_adapter(self) -> DLPackGrads:
        return DLPackGrads(self)

    def adapt(self, module: object) -> NoReturn:
        raise ConfigTypeError(
            f"nccl_ddp has no DistributedDataParallel for {self.name} models "
            f"({type(module).__module__}.{type(module).__name__}): pass the list of its "
            f"parameters (DistributedDataParallel([p1, p2, ...]) and mark_ready(i, grad=...) "
            f"as grads appear), or reduce the grads after backward with "
            f"nccl_ddp.DistributedGradReducer(parameters)"
        )


def find_from_dlpack(module: ModuleType, name: str) -> FromDLPack:
    """`module.from_dlpack` or the first of `FROM_DLPACK_PATHS` the module has."""
    for path in FROM_DLPACK_PATHS:
        obj: object = module
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if callable(obj):
            return obj
    raise ConfigTypeError(
        f"the framework {name!r} has arrays with __dlpack__ but no from_dlpack (looked for "
        f"{', '.join(f'{name}.{p}' for p in FROM_DLPACK_PATHS)}), so nccl_ddp cannot hand its "
        f"results back as {name} arrays: pass NumPy arrays (x.numpy()) and convert back yourself"
    )


class DLPackGrads(GradsAdapter):
    """Parameters and grads: lists or tuples of one framework's arrays, in the same order."""

    def __init__(self, framework: GenericAdapter) -> None:
        self.framework = framework

    def check_leaf(self, what: str, x: object) -> None:
        """`x` must be an array of this reducer's framework (never mixed in silently)."""
        name = frameworks.framework_of(x)
        if name == self.framework.name:
            return
        if x is None:
            raise ConfigError(
                f"{what} is None (a parameter that got no grad): pass zeros of its shape, or "
                f"build the reducer on the parameters that get grads"
            )
        raise frameworks.mixed_frameworks(what, x, self.framework.name, f"{self.framework.name} arrays")

    def param_infos(self, parameters: object) -> List[ParamSpec]:
        if not isinstance(parameters, (list, tuple)) or not parameters:
            raise ConfigTypeError(
                f"parameters must be a non-empty list or tuple of {self.framework.name} arrays, "
                f"got {type(parameters).__name__}"
            )
        specs = []
        for i, p in enumerate(parameters):
            self.check_leaf(f"parameters[{i}]", p)
            if not hasattr(p, "__dlpack__"):
                raise ConfigTypeError(cannot_exchange(p, f"parameters[{i}]"))
            name = getattr(p, "name", None)
            name = name if isinstance(name, str) else None
            specs.append(ParamSpec(tuple(p.shape), numpy_dtype(p.dtype), name))
        self.framework.from_dlpack()  # a framework we could not hand results back to: now
        return specs

    def leaves(self, grads: object) -> Sequence[Any]:
        if not isinstance(grads, (list, tuple)):
            raise ConfigTypeError(
                f"grads must be a list or tuple of {self.framework.name} arrays, got {type(grads).__name__}"
            )
        for i, g in enumerate(grads):
            self.check_leaf(f"grads[{i}]", g)
        return grads

    def to_native(self, grads: object) -> List[NativeArray]:
        return [native_view(g, f"grads[{i}]") for i, g in enumerate(self.leaves(grads))]

    def from_native(self, grads: Sequence[object], reduced: Sequence[NativeArray]) -> Sequence[object]:
        out = [self.framework.array_from_native(r, g) for r, g in zip(reduced, grads)]
        return tuple(out) if isinstance(grads, tuple) else out


if TYPE_CHECKING:  # the generic adapter is a FrameworkAdapter: mypy checks every member here
    _contract: FrameworkAdapter = GenericAdapter("")
