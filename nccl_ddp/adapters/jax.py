"""JAX adapter: `DistributedGradReducer` over a pytree of `jax.Array` grads, returning a new pytree
(JAX arrays are immutable), bucketed and pipelined by the reducer.

In: every leaf is read through DLPack without a copy (`numpy.from_dlpack` gives a read-only view
on the CPU, `cupy.from_dlpack` on the GPU); the reducer packs it into fresh bucket memory. Out:
each reduced grad is a slice of that fresh memory handed to `jax.dlpack.from_dlpack`; JAX keeps it
without a copy when the slice meets its alignment (64 bytes on the CPU) and copies it otherwise.
The memory is never reused, so the returned arrays stay immutable. bfloat16 leaves cross as
uint16 bits (NumPy and CuPy have no bfloat16 DLPack type), which costs a bitcast each way.

JAX has no per-parameter grad hooks and `jax.grad` returns all grads at once, so there is no
JAX `DistributedDataParallel`: reduce the grads pytree after `jax.grad` instead.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from ._dlpack import KDL_CPU, KDL_CUDA, bfloat16_dtype, native_from_dlpack
from .grads import GradsAdapter, ParamInfo


def adapt(module: Any) -> Any:
    raise TypeError("JAX models have no grad hooks for DistributedDataParallel: compute grads with "
                    "jax.grad and reduce the pytree with nccl_ddp.DistributedGradReducer(params)")


def grads_adapter() -> "JaxGrads":
    return JaxGrads()


def _is_bf16(x: Any) -> bool:
    return np.dtype(x.dtype) == bfloat16_dtype()


def to_native(x: Any) -> Any:
    """A native array viewing the JAX array `x` (read-only on the CPU)."""
    import jax
    import jax.numpy as jnp
    if not isinstance(x, jax.Array):
        raise TypeError(f"expected a jax.Array leaf, got {type(x).__module__}.{type(x).__name__}")
    kind = int(x.__dlpack_device__()[0])
    if kind not in (KDL_CPU, KDL_CUDA):
        raise TypeError(f"JAX arrays on {x.devices()} are not supported (CPU or CUDA only)")
    if _is_bf16(x):
        bits = native_from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint16), kind)
        return bits.view(bfloat16_dtype()) if kind == KDL_CPU else bits
    return native_from_dlpack(x, kind)


def from_native(a: Any, bf16: bool = False) -> Any:
    """A JAX array over the native array `a` (zero-copy where JAX's alignment allows)."""
    import jax
    import jax.numpy as jnp
    if bf16:
        bits = a.view(np.uint16) if isinstance(a, np.ndarray) else a
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(bits), jnp.bfloat16)
    return jax.dlpack.from_dlpack(a)


class JaxGrads(GradsAdapter):
    """Parameters and grads: pytrees of `jax.Array` (any JAX pytree: dicts, lists, flax
    structures); leaves are matched in `jax.tree_util` flattening order."""

    def param_infos(self, parameters: Any) -> List[ParamInfo]:
        import jax
        leaves = jax.tree_util.tree_flatten_with_path(parameters)[0]
        return [ParamInfo(tuple(x.shape), np.dtype(x.dtype), jax.tree_util.keystr(path))
                for path, x in leaves]

    def to_native(self, grads: Any) -> List[Any]:
        import jax
        leaves = jax.tree_util.tree_leaves(grads)
        self._bf16 = [_is_bf16(x) for x in leaves]
        if any(self._bf16) and any(int(x.__dlpack_device__()[0]) == KDL_CUDA for x in leaves):
            raise TypeError("bfloat16 JAX grads on the GPU have no CuPy dtype; reduce them in "
                            "float32 (or float16)")
        return [to_native(x) for x in leaves]

    def from_native(self, grads: Any, reduced: List[Any]) -> Any:
        import jax
        treedef = jax.tree_util.tree_structure(grads)
        return jax.tree_util.tree_unflatten(
            treedef, [from_native(a, bf16) for a, bf16 in zip(reduced, self._bf16)])
