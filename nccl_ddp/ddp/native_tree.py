"""NumPy / CuPy arrays in a list, tuple or dict (str keys) seen as a `GradsAdapter`: what the
frameworks' adapters do for their own structures (JAX's pytrees, Paddle's lists), for the
backends' own arrays, which need no adapter. `ShardedParams` uses it for NumPy parameters."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Union

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.interfaces import GradsAdapter
from nccl_ddp.errors import ConfigError, ConfigTypeError

Tree = Union[Sequence[NativeArray], Mapping[str, NativeArray]]


class NativeTree(GradsAdapter):
    """Parameters: a non-empty list, tuple or dict (str keys) of NumPy / CuPy arrays; grads: the
    same container with the same keys (or length), each leaf an array of the backends'."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.keys: Optional[List[Any]] = None  # dict keys in order, or None for a list/tuple
        self.count = 0

    def param_infos(self, parameters: Any) -> List[ParamSpec]:
        if isinstance(parameters, Mapping):
            for k in parameters:
                if not isinstance(k, str):
                    raise ConfigTypeError(f"{self.owner}: dict keys of params must be str, got {k!r}")
            self.keys = list(parameters)
        elif not isinstance(parameters, (list, tuple)):
            raise ConfigTypeError(
                f"{self.owner}: params must be a list, tuple or dict of NumPy/CuPy arrays (or a JAX "
                f"pytree, or a list of one framework's tensors), got {type(parameters).__name__}"
            )
        leaves = self.leaves(parameters, f"{self.owner}: params", check=False)
        if not leaves:
            raise ConfigError(f"{self.owner}: params has no arrays")
        self.count = len(leaves)
        names = self.keys if self.keys is not None else [None] * len(leaves)
        return [ParamSpec(tuple(x.shape), x.dtype, n) for x, n in zip(leaves, names)]

    def leaves(self, tree: Any, what: str, check: bool = True) -> List[NativeArray]:
        """The arrays of `tree` in order; with `check`, its container must be the parameters'.
        `what` starts the messages (the caller adds which rank and call)."""
        if self.keys is not None and check:
            if not isinstance(tree, Mapping) or list(tree) != self.keys:
                got = list(tree) if isinstance(tree, Mapping) else type(tree).__name__
                raise ConfigError(
                    f"{what} must be a dict with the parameters' keys {self.keys} in that order, got {got}"
                )
        elif check and (not isinstance(tree, (list, tuple)) or len(tree) != self.count):
            got = f"{len(tree)} entries" if isinstance(tree, (list, tuple)) else type(tree).__name__
            raise ConfigError(
                f"{what} must be a list or tuple of {self.count} arrays (one per "
                f"parameter, in order), got {got}"
            )
        items = list(tree.items()) if isinstance(tree, Mapping) else list(enumerate(tree))
        for k, x in items:
            if frameworks.framework_of(x) is not None or not hasattr(x, "shape"):
                raise ConfigTypeError(
                    f"{what}[{k!r}] is a {type(x).__module__}.{type(x).__name__}, "
                    "but these parameters are NumPy/CuPy arrays: pass arrays of the parameters' "
                    "framework; nccl_ddp never mixes frameworks"
                )
        return [x for _, x in items]

    def to_native(self, grads: Any) -> List[NativeArray]:
        return self.leaves(grads, "grads")

    def from_native(self, grads: Any, reduced: Sequence[NativeArray]) -> Any:
        if isinstance(grads, Mapping):
            return dict(zip(grads, reduced))
        return tuple(reduced) if isinstance(grads, tuple) else list(reduced)
