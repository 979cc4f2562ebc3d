"""The raw-array "module": parameters and grads as plain NumPy / CuPy arrays, for code that does
its own backprop. This is how any framework without an adapter plugs in.

    model = ArrayModule({"w1": w1, "b1": b1, "w2": w2}, forward=my_forward)   # or a list
    ddp = nd.DistributedDataParallel(model)
    for x, y in batches:
        out = ddp(x)                         # calls my_forward(model.params, x); opens the step
        ...                                  # your backward, last layer first:
        ddp.mark_ready("w2", grad=gw2)       # adds gw2 to model.grads["w2"], may launch a bucket
        ...
        ddp.mark_ready("w1", grad=gw1)       # the last one finalizes: grads are now averaged
        sgd(model.params, model.grads)
        ddp.zero_grad()                      # grads accumulate until you zero them

Instead of passing `grad=` you may write into `model.grads[k]` in place and call
`ddp.mark_ready(k)`. On the default fused-bucket path, `model.grads[k]` are views of the bucket
buffers (assigned when DDP is built): keep reading them through `model.grads`, never hold on to an old one.

The arrays may also be any framework's writable DLPack arrays (all of one framework: Paddle
tensors, torch tensors outside a module): the parameters stay the caller's objects, the core works
on zero-copy DLPack views of them, grads given to `mark_ready` are read through DLPack, and
`model.grads[k]` are that framework's arrays over the bucket views (its `from_dlpack`, which must
not copy). Immutable or read-only arrays (JAX, TensorFlow) are refused: the initial broadcast and
the optimizer write parameters in place; reduce their grads with `DistributedGradReducer`.

The contract with the core (what an adapter for another framework provides,
`nccl_ddp.ddp.interfaces.GradModule`):
native arrays (NumPy/CuPy) for parameters and grads, a callback to make the framework's grads alias
bucket views, and a conversion of the framework's grads to native arrays (DLPack).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import numpy as np

from nccl_ddp.adapters.generic import GenericAdapter
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import native_view
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.ddp.interfaces import GradModule
from nccl_ddp.errors import ConfigError, ConfigTypeError


class ArrayModule(GradModule):
    """Parameters as a list or dict of NumPy / CuPy arrays (or one framework's writable DLPack
    arrays); `grads` has the same structure.

    `forward(params, *args, **kwargs)` (optional) is what calling the DDP wrapper runs.
    """

    def __init__(
        self,
        params: Union[Sequence[object], Mapping[str, object]],
        forward: Optional[Callable[..., object]] = None,
    ) -> None:
        if isinstance(params, Mapping):
            self.keys: list = list(params)
            for k in self.keys:
                if not isinstance(k, str):
                    raise ConfigTypeError(f"ArrayModule params: dict keys must be str, got {k!r}")
            self.params: Union[list, dict] = dict(params)
            self.names = list(self.keys)
        elif isinstance(params, (list, tuple)):
            self.keys = list(range(len(params)))
            self.params = list(params)
            self.names = [None] * len(params)
        else:
            raise ConfigTypeError(
                f"ArrayModule params must be a list, tuple or dict of arrays, got {type(params).__name__}"
            )
        self._framework = _framework_of_params(self.params, self.keys)
        self._natives = [_check_array(f"params[{k!r}]", self.params[k], self._framework) for k in self.keys]
        if forward is not None and not callable(forward):
            raise ConfigTypeError(f"ArrayModule forward must be callable, got {type(forward).__name__}")
        self._forward = forward
        self._native_grads = [_xp(p).zeros(p.shape, dtype=p.dtype) for p in self._natives]
        grads = [self._user_grad(g) for g in self._native_grads]
        self.grads: Union[list, dict] = (
            dict(zip(self.keys, grads)) if isinstance(self.params, dict) else grads
        )

    def __len__(self) -> int:
        return len(self.keys)

    def native_params(self) -> List[NativeArray]:
        return list(self._natives)

    def native_grads(self) -> List[NativeArray]:
        return list(self._native_grads)

    @property
    def can_install_grads(self) -> bool:
        return True

    def install_grad(self, i: int, view: NativeArray) -> None:
        self._native_grads[i] = view
        self.grads[self.keys[i]] = self._user_grad(view)

    def _user_grad(self, native: NativeArray) -> object:
        """What `grads[k]` holds for a native grad: itself, or the framework's array over it."""
        if self._framework is None:
            return native
        grad = self._framework.array_from_native(native)
        if not _shares(native_view(grad, "grads"), native):
            raise ConfigError(
                f"{self._framework.name}'s from_dlpack copies the grad buffers nccl_ddp reduces "
                f"into, so ArrayModule.grads could not show the reduced grads; reduce the grads "
                f"with DistributedGradReducer instead"
            )
        return grad

    def to_native(self, i: int, grad: Any) -> NativeArray:
        """A grad given to mark_ready: a native array, or a DLPack view of the framework's."""
        if self._framework is None or type(grad).__module__.split(".")[0] in frameworks.NATIVE:
            return grad
        return native_view(grad, f"the grad of params[{self.keys[i]!r}]")

    def index_of(self, key: object) -> int:
        """Index of a parameter given by dict key (str) or the array object itself."""
        if isinstance(key, str):
            if key in self.keys:
                return self.keys.index(key)
            raise KeyError(key)
        for i, k in enumerate(self.keys):
            if self.params[k] is key:
                return i
        raise KeyError(key)

    def forward(self, *args: object, **kwargs: object) -> object:
        if self._forward is None:
            raise ConfigTypeError(
                "this ArrayModule has no forward function; pass forward= to "
                "ArrayModule(...) or run your model yourself and only call mark_ready"
            )
        return self._forward(self.params, *args, **kwargs)


def _xp(a: NativeArray) -> ModuleType:
    if isinstance(a, np.ndarray):
        return np
    import cupy  # only reached for CuPy arrays

    return cupy


def _framework_of_params(params: Union[list, dict], keys: list) -> Optional[GenericAdapter]:
    """The generic adapter of the parameters' framework (None for NumPy / CuPy); all must share it."""
    names = {frameworks.framework_of(params[k]) for k in keys}
    if len(names) > 1:
        shown = sorted(n or "numpy/cupy" for n in names)
        raise ConfigTypeError(
            f"ArrayModule params mix frameworks ({', '.join(shown)}): pass arrays of one framework"
        )
    name = names.pop() if names else None
    return None if name is None else GenericAdapter(name)


def _shares(a: NativeArray, b: NativeArray) -> bool:
    return bool(_xp(a).may_share_memory(a, b))


def _check_array(what: str, a: Any, framework: Optional[GenericAdapter]) -> NativeArray:
    """The native array the core uses for parameter `a` (itself, or a DLPack view of it)."""
    if frameworks.is_immutable(a):
        raise ConfigError(
            f"ArrayModule {what} is a {type(a).__module__}.{type(a).__name__}, whose arrays are "
            "immutable, but the initial broadcast and the optimizer write parameters in place: "
            "reduce the grads with DistributedGradReducer(params) instead"
        )
    if framework is not None:
        native = native_view(a, f"ArrayModule {what}")
    else:
        native = a
        mod = type(a).__module__.split(".")[0]
        if mod not in ("numpy", "cupy") or not hasattr(a, "shape"):
            raise ConfigTypeError(
                f"ArrayModule {what} must be an array (NumPy, CuPy or any framework's writable "
                f"DLPack array), got {type(a).__module__}.{type(a).__name__}; pass a "
                "torch.nn.Module or MindSpore Cell itself, or for JAX use DistributedGradReducer"
            )
    if not native.flags.c_contiguous:
        raise ConfigError(f"ArrayModule {what} must be C-contiguous (collectives write it in place)")
    if not getattr(native.flags, "writeable", True):
        raise ConfigError(
            f"ArrayModule {what} is read-only, but the initial broadcast and the "
            "optimizer write it in place; pass a writable array (x.copy()), or for an immutable "
            "framework's arrays (JAX, TensorFlow) reduce the grads with DistributedGradReducer"
        )
    return native
