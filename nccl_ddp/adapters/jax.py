"""JAX adapter: `DistributedGradReducer` over a pytree of `jax.Array` grads, returning a new pytree
(JAX arrays are immutable), bucketed and pipelined by the reducer.

In: every leaf is read without a copy (`numpy.from_dlpack` gives a read-only view on the CPU,
`cupy.from_dlpack` on the GPU); the reducer packs it into fresh bucket memory. Out: each reduced
grad is a slice of that memory handed to `jax.dlpack.from_dlpack`, which keeps it without a copy
when the slice meets JAX's alignment (64 bytes on the CPU: the host device allocates buckets and
places grads at 64-byte boundaries, so every leaf is aliased there) and copies it otherwise. The
reducer allocates new buckets per call and never writes them after it returns, so a returned leaf
never changes, and it keeps its bucket alive. bfloat16 has no NumPy DLPack type: on the CPU it
goes in through `numpy.asarray` (a read-only view) and out through `jax.device_put`, which aliases
aligned NumPy memory as well; on the GPU CuPy 14's DLPack reads it as ml_dtypes.bfloat16.

JAX has no per-parameter grad hooks and `jax.grad` returns all grads at once, so there is no
JAX `DistributedDataParallel`: reduce the grads pytree after `jax.grad` instead.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from nccl_ddp.ddp.buckets import ParamSpec
from nccl_ddp.ddp.interfaces import GradsAdapter
from nccl_ddp.dlpack import KDL_CPU, KDL_CUDA, bfloat16_dtype, native_from_dlpack
from nccl_ddp.errors import ConfigError, ConfigTypeError


def adapt(module: Any) -> Any:
    raise ConfigTypeError("JAX models have no grad hooks for DistributedDataParallel: compute grads with "
                    "jax.grad and reduce the pytree with nccl_ddp.DistributedGradReducer(params)")


def grads_adapter() -> JaxGrads:
    return JaxGrads()


def first_leaf(obj: Any) -> Any:
    """The first leaf of any pytree (None for an empty one)."""
    import jax
    leaves = jax.tree_util.tree_leaves(obj)
    return leaves[0] if leaves else None


def array_from_native(native: Any) -> Any:
    """A new JAX array holding a native (NumPy / CuPy) array's values: what a collective returns
    to a JAX caller, whose arrays are immutable."""
    import numpy
    if isinstance(native, numpy.ndarray):
        import jax.numpy as jnp
        return jnp.asarray(native)
    import jax.dlpack
    return jax.dlpack.from_dlpack(native)


def _is_bf16(x: Any) -> bool:
    return np.dtype(x.dtype) == bfloat16_dtype()


def to_native(x: Any) -> Any:
    """A native array viewing the JAX array `x` (read-only on the CPU)."""
    import jax
    if isinstance(x, jax.core.Tracer):
        raise ConfigError(
            f"a grad is a {type(x).__name__}: DistributedGradReducer was called inside jax.jit "
            "(or another JAX transformation), where grads are abstract tracers with no memory to "
            "communicate. Reduce the grads the jitted function returns, outside it: "
            "grads = jax.jit(jax.grad(loss))(params, batch); grads = reducer(grads)")
    if not isinstance(x, jax.Array):
        raise ConfigTypeError(f"expected a jax.Array leaf, got {type(x).__module__}.{type(x).__name__}")
    kind = int(x.__dlpack_device__()[0])
    if kind not in (KDL_CPU, KDL_CUDA):
        raise ConfigTypeError(f"JAX arrays on {x.devices()} are not supported (CPU or CUDA only)")
    if _is_bf16(x) and kind == KDL_CPU:   # NumPy's DLPack knows no bfloat16
        return np.asarray(x)    # JAX's own zero-copy NumPy view (ml_dtypes.bfloat16)
    return native_from_dlpack(x, kind)   # CuPy 14 reads bfloat16 as ml_dtypes.bfloat16


def from_native(a: Any, device: Any) -> Any:
    """A JAX array on `device` over the native array `a`: zero-copy where JAX's alignment allows,
    a copy otherwise."""
    import jax
    if isinstance(a, np.ndarray) and a.dtype == bfloat16_dtype():
        return jax.device_put(a, device)
    return jax.dlpack.from_dlpack(a, device=device)


class JaxGrads(GradsAdapter):
    """Parameters and grads: pytrees of `jax.Array` (any JAX pytree: dicts, lists, flax
    structures); leaves are matched in `jax.tree_util` flattening order."""

    def param_infos(self, parameters: Any) -> List[ParamSpec]:
        import jax
        leaves = jax.tree_util.tree_flatten_with_path(parameters)[0]
        return [ParamSpec(tuple(x.shape), np.dtype(x.dtype), jax.tree_util.keystr(path))
                for path, x in leaves]

    def to_native(self, grads: Any) -> List[Any]:
        import jax
        return [to_native(x) for x in jax.tree_util.tree_leaves(grads)]

    def from_native(self, grads: Any, reduced: List[Any]) -> Any:
        import jax
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        return jax.tree_util.tree_unflatten(
            treedef, [from_native(a, next(iter(x.devices()))) for a, x in zip(reduced, leaves)])
