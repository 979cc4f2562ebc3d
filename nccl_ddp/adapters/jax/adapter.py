"""JAX adapter: `DistributedGradReducer` over a pytree of `jax.Array` grads, returning a new pytree
(JAX arrays are immutable), bucketed and pipelined by the reducer.

In: every leaf is read without a copy (`numpy.from_dlpack` gives a read-only view on the CPU,
`cupy.from_dlpack` on the GPU); the reducer packs it into its bucket and copies the reduced bucket
out into fresh memory. Out: each reduced grad is a slice of that memory handed to
`jax.dlpack.from_dlpack`, which keeps it without a copy when the slice meets JAX's alignment (64
bytes on the CPU: the host device allocates buckets and places grads at 64-byte boundaries, so
every leaf is aliased there) and copies it otherwise. The reducer never writes that memory after it
returns (each call copies out into memory of its own), so a returned leaf never changes, and it
keeps its memory alive. bfloat16 has no NumPy DLPack type: on the CPU it goes in through
`numpy.asarray` (a read-only view) and out through `jax.device_put`, which aliases aligned NumPy
memory as well; on the GPU CuPy 14's DLPack reads it as ml_dtypes.bfloat16.

JAX has no per-parameter grad hooks and `jax.grad` returns all grads at once, so there is no
JAX `DistributedDataParallel`: reduce the grads pytree after `jax.grad` instead.

Inside `jax.jit` (the grads are tracers) the reducer becomes one ordered `io_callback`: at run time
XLA hands the grads to the host, the reducer all-reduces them there and XLA copies the results
back into the graph. Ordered, so every rank issues its collectives in program order and XLA never
drops or reorders the call; a call that raises on one rank (which the user may catch and go on)
poisons the group, so no rank's later collectives pair up with another step's; the cost (a host
round trip and a copy each way) is measured in docs/benchmarks.md. The grads must have the
parameters' pytree structure (refused otherwise, naming the first key path that differs) and be
JAX arrays: NumPy or torch leaves are refused, never mixed in silently.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, List, NoReturn, Optional, Sequence

import numpy as np

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import KDL_CPU, KDL_CUDA, is_bfloat16, native_from_dlpack
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradsAdapter, ReduceNative
from nccl_ddp.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import jax

Pytree = object
"""Any JAX pytree (dicts, lists, flax structures): only `jax.tree_util` looks inside."""


def adapt(module: object) -> NoReturn:
    raise ConfigTypeError(
        "JAX models have no grad hooks for DistributedDataParallel: compute grads with "
        "jax.grad and reduce the pytree with nccl_ddp.DistributedGradReducer(params)"
    )


def grads_adapter() -> JaxGrads:
    return JaxGrads()


def first_leaf(obj: Pytree) -> object:
    """The first leaf of any pytree (None for an empty one)."""
    import jax

    leaves = jax.tree_util.tree_leaves(obj)
    return leaves[0] if leaves else None


def array_from_native(native: NativeArray, like: object = None) -> jax.Array:
    """A new JAX array holding a native (NumPy / CuPy) array's values: what a collective returns
    to a JAX caller, whose arrays are immutable."""
    import numpy

    if isinstance(native, numpy.ndarray):
        import jax.numpy as jnp

        return jnp.asarray(native)
    import jax.dlpack

    return jax.dlpack.from_dlpack(native)


def dlpack_source(x: object) -> None:
    """None: JAX arrays speak `__dlpack__` themselves."""
    return None


def _is_bf16(x: jax.Array) -> bool:
    return is_bfloat16(x.dtype)


def to_native(x: jax.Array) -> NativeArray:
    """A native array viewing the JAX array `x` (read-only on the CPU)."""
    import jax

    if isinstance(x, jax.core.Tracer):
        raise ConfigError(
            f"a grad is a {type(x).__name__}: DistributedGradReducer was called inside jax.jit "
            "(or another JAX transformation), where grads are abstract tracers with no memory to "
            "communicate. Reduce the grads the jitted function returns, outside it: "
            "grads = jax.jit(jax.grad(loss))(params, batch); grads = reducer(grads)"
        )
    if not isinstance(x, jax.Array):
        raise ConfigTypeError(f"expected a jax.Array leaf, got {type(x).__module__}.{type(x).__name__}")
    kind = int(x.__dlpack_device__()[0])
    if kind not in (KDL_CPU, KDL_CUDA):
        raise ConfigTypeError(f"JAX arrays on {x.devices()} are not supported (CPU or CUDA only)")
    if _is_bf16(x) and kind == KDL_CPU:  # NumPy's DLPack knows no bfloat16
        return np.asarray(x)  # JAX's own zero-copy NumPy view (ml_dtypes.bfloat16)
    return native_from_dlpack(x, kind)  # CuPy 14 reads bfloat16 as ml_dtypes.bfloat16


def from_native(a: NativeArray, device: Optional[jax.Device] = None) -> jax.Array:
    """A JAX array on `device` (None: JAX's default) over the native array `a`: zero-copy where
    JAX's alignment allows, a copy otherwise."""
    import jax

    if isinstance(a, np.ndarray) and is_bfloat16(a.dtype):
        return jax.device_put(a, device)
    return jax.dlpack.from_dlpack(a, device=device)


class JaxGrads(GradsAdapter):
    """Parameters and grads: pytrees of `jax.Array` (any JAX pytree: dicts, lists, flax
    structures) of the same structure; leaves are matched in `jax.tree_util` flattening order."""

    def __init__(self) -> None:
        self._treedef: Optional[jax.tree_util.PyTreeDef] = None
        self._paths: List[str] = []
        self.native_module: ModuleType = np  # the reducer's arrays (CuPy on the GPU): bind()
        self.group: Optional[ProcessGroup] = None  # the reducer's process group: bind()

    def bind(self, native_module: ModuleType, group: ProcessGroup) -> None:
        self.native_module, self.group = native_module, group

    def param_infos(self, parameters: Pytree) -> List[ParamSpec]:
        import jax

        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(parameters)
        self._paths = [jax.tree_util.keystr(path) for path, _ in leaves]
        return [
            ParamSpec(tuple(x.shape), np.dtype(x.dtype), keystr)
            for keystr, (_, x) in zip(self._paths, leaves)
        ]

    def leaves(self, grads: Pytree) -> List[jax.Array]:
        """The grads' leaves, once their structure is the parameters' and each is a JAX array."""
        import jax

        flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        if self._treedef is not None and treedef != self._treedef:
            raise ConfigError(structure_difference(self._paths, paths, self._treedef, treedef))
        for path, (_, x) in zip(paths, flat):
            if not isinstance(x, (jax.Array, jax.core.Tracer)):
                raise frameworks.mixed_frameworks(f"grad {path}", x, "jax", "JAX arrays (jnp.asarray)")
        return [x for _, x in flat]

    def to_native(self, grads: Pytree) -> List[NativeArray]:
        return [to_native(x) for x in self.leaves(grads)]

    def from_native(self, grads: Pytree, reduced: Sequence[NativeArray]) -> Pytree:
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(grads)
        return jax.tree_util.tree_unflatten(
            treedef, [from_native(a, next(iter(x.devices()))) for a, x in zip(reduced, leaves)]
        )

    def reduce(self, reduce_native: ReduceNative, grads: Pytree) -> Pytree:
        import jax

        leaves = self.leaves(grads)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._reduce_in_jit(reduce_native, grads, leaves)
        return self.from_native(grads, reduce_native([to_native(x) for x in leaves]))

    def _reduce_in_jit(self, reduce_native: ReduceNative, grads: Pytree, leaves: List[jax.Array]) -> Pytree:
        """The reduction as one ordered io_callback in the traced graph (see the module doc)."""
        import jax
        from jax.experimental import io_callback

        xp = self.native_module

        def on_host(*arrays: jax.Array) -> tuple:
            try:
                native = [np.asarray(a) if xp is np else xp.asarray(np.asarray(a)) for a in arrays]
                return tuple(np.asarray(r) if xp is np else xp.asnumpy(r) for r in reduce_native(native))
            except Exception as e:  # XLA hands it to the caller, who may catch it and go on
                _poison(self.group, e)
                raise

        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
        out = io_callback(on_host, shapes, *leaves, ordered=True)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(grads), list(out))


def _poison(group: Optional[ProcessGroup], e: BaseException) -> None:
    """The reduction of a jitted step failed on this rank, whose peers ran (or are running) it:
    the group is poisoned, so every later collective on every rank raises naming this failure
    instead of pairing this rank's next step with the peers' current one."""
    if group is not None and not group.failed:
        group.poison(
            f"rank {group.ranks[group.rank]}: DistributedGradReducer inside jax.jit failed on "
            f"this rank ({type(e).__name__}: {e})"
        )


def structure_difference(
    want: List[str], got: List[str], want_def: jax.tree_util.PyTreeDef, got_def: jax.tree_util.PyTreeDef
) -> str:
    """Why the grads' pytree is not the parameters': the first key path that differs."""
    for i in range(max(len(want), len(got))):
        w = want[i] if i < len(want) else None
        g = got[i] if i < len(got) else None
        if w == g:
            continue
        if g is None or (w is not None and w not in got and g in want):
            what = f"the grads lack the parameters' key {w}"
        elif w is None or (g not in want and w in got):
            what = f"the grads have key {g}, which the parameters lack"
        elif g not in want:
            what = f"the grads have key {g} where the parameters have {w}"
        else:
            what = f"key {g} comes where the parameters have {w} (a different order)"
        hint = ""
        if len(got) == len(want) and all(p == "['params']" + q for p, q in zip(got, want)):
            hint = "; the grads carry flax's {'params': ...} wrapper: pass grads['params']"
        return (
            f"the grads' pytree structure differs from the parameters' ({len(got)} leaves "
            f"for {len(want)}): {what}{hint}"
        )
    return (
        f"the grads' pytree has the parameters' key paths but other containers: "
        f"{str(got_def)[:200]} for the parameters' {str(want_def)[:200]}; pass grads of the "
        f"parameters' structure (jax.grad of a function of those parameters gives them)"
    )


if TYPE_CHECKING:  # this module is JAX's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.jax import adapter as _this
    from nccl_ddp.arrays.frameworks import PytreeAdapter

    _contract: FrameworkAdapter = _this
    _pytrees: PytreeAdapter = _this  # frameworks.first_leaf's
