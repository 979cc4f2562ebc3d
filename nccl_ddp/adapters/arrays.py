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
`ddp.mark_ready(k)`. With the default CppReducer, `model.grads[k]` are views of the bucket buffers
(assigned when DDP is built): keep reading them through `model.grads`, never hold on to an old one.

The contract with the core (what an adapter for another framework provides,
`nccl_ddp.ddp.interfaces.GradModule`):
native arrays (NumPy/CuPy) for parameters and grads, a callback to make the framework's grads alias
bucket views, and a conversion of the framework's grads to native arrays (DLPack).
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import numpy as np

from nccl_ddp.ddp.interfaces import GradModule
from nccl_ddp.errors import ConfigError, ConfigTypeError


class ArrayModule(GradModule):
    """Parameters as a list or dict of NumPy / CuPy arrays; `grads` has the same structure.

    `forward(params, *args, **kwargs)` (optional) is what calling the DDP wrapper runs.
    """

    def __init__(
        self, params: Union[Sequence[Any], Mapping[str, Any]], forward: Optional[Callable[..., Any]] = None
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
        for k in self.keys:
            _check_array(f"params[{k!r}]", self.params[k])
        if forward is not None and not callable(forward):
            raise ConfigTypeError(f"ArrayModule forward must be callable, got {type(forward).__name__}")
        self._forward = forward
        self.grads: Any = type(self.params)() if isinstance(self.params, dict) else []
        for k in self.keys:
            p = self.params[k]
            z = _xp(p).zeros(p.shape, dtype=p.dtype)
            if isinstance(self.grads, dict):
                self.grads[k] = z
            else:
                self.grads.append(z)

    def __len__(self) -> int:
        return len(self.keys)

    def native_params(self) -> List[Any]:
        return [self.params[k] for k in self.keys]

    def native_grads(self) -> List[Any]:
        return [self.grads[k] for k in self.keys]

    @property
    def can_install_grads(self) -> bool:
        return True

    def install_grad(self, i: int, view: Any) -> None:
        self.grads[self.keys[i]] = view

    def index_of(self, key: Any) -> int:
        """Index of a parameter given by dict key (str) or the array object itself."""
        if isinstance(key, str):
            if key in self.keys:
                return self.keys.index(key)
            raise KeyError(key)
        for i, k in enumerate(self.keys):
            if self.params[k] is key:
                return i
        raise KeyError(key)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward is None:
            raise ConfigTypeError(
                "this ArrayModule has no forward function; pass forward= to "
                "ArrayModule(...) or run your model yourself and only call mark_ready"
            )
        return self._forward(self.params, *args, **kwargs)


def _xp(a: Any):
    if isinstance(a, np.ndarray):
        return np
    import cupy  # only reached for CuPy arrays

    return cupy


def _check_array(what: str, a: Any) -> None:
    mod = type(a).__module__.split(".")[0]
    if mod not in ("numpy", "cupy") or not hasattr(a, "shape"):
        raise ConfigTypeError(
            f"ArrayModule {what} must be a NumPy or CuPy array, got "
            f"{type(a).__module__}.{type(a).__name__}; pass a torch.nn.Module or "
            "MindSpore Cell itself, or for JAX use DistributedGradReducer"
        )
    if not a.flags.c_contiguous:
        raise ConfigError(f"ArrayModule {what} must be C-contiguous (collectives write it in place)")
    if not getattr(a.flags, "writeable", True):
        raise ConfigError(
            f"ArrayModule {what} is read-only, but the initial broadcast and the "
            "optimizer write it in place; pass a writable array (x.copy())"
        )
