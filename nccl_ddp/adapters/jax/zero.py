"""JAX + optax on sharded optimizer state and gradients (ZeRO-2), functional:

    zopt = nd.ZeroOptimizer(params, optax.adamw(1e-3))   # cuts the shards; a collective
    state = zopt.init(params)
    params, state = zopt.step(params, grads, state)      # grads: this rank's, unreduced

Rank r keeps the float32 master weights, the optax state and the reduced grads of its slice of
every flat bucket (zero/layout.py) and nothing else; a step packs the grads into the flat
buckets and reduce-scatters each (mean, zero/reduce_scatter.py), runs the optax transformation on the
rank's flat shards, and all-gathers the parameters (zero/shards.py). Sharding is exact only
for elementwise transformations (adam, adamw, sgd, schedules, ...): the constructor probes the
transformation and refuses one whose update of a shard differs from its update of the whole
(global-norm clipping, LAMB, adafactor, masks that depend on a leaf's shape).

`ShardOptax(tx)` is the same transformation as a flat-shard optimizer for `nd.ShardedParams`
(ZeRO-3): one optax state per shard, the interface of nd.ShardSGD / nd.ShardAdamW.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.adapters.jax.adapter import Pytree, from_native, to_native
from nccl_ddp.comm.api import device_of, get_world_group
from nccl_ddp.comm.collectives import broadcast
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.zero.config import ZeroConfig
from nccl_ddp.zero.core import build_core

if TYPE_CHECKING:
    import jax
    import optax


def check_elementwise(tx: optax.GradientTransformation, steps: int = 3) -> None:
    """ConfigError unless `tx` updates a parameter vector cut into shards (each with its own
    state, as ranks hold them) exactly as it updates the whole pytree. The probe: a (3, 5) matrix
    and a (7,) vector, cut through the matrix, 3 steps of grads large enough to trigger clipping
    and trust ratios."""
    import jax.numpy as jnp

    rng = np.random.default_rng(12345)
    tree = {
        "b": rng.standard_normal(7).astype(np.float32),
        "w": rng.standard_normal((3, 5)).astype(np.float32),
    }
    flat = np.concatenate([tree["b"], tree["w"].ravel()])
    cuts = [(0, 9), (9, flat.size)]
    whole = {k: jnp.asarray(v) for k, v in tree.items()}
    pieces = [jnp.asarray(flat[lo:hi]) for lo, hi in cuts]
    try:
        s_whole = tx.init(whole)
        s_pieces = [tx.init([p]) for p in pieces]
        for t in range(steps):
            g = (rng.standard_normal(flat.size) * 10.0 ** (t + 1)).astype(np.float32)
            g_tree = {"b": jnp.asarray(g[:7]), "w": jnp.asarray(g[7:].reshape(3, 5))}
            u_whole, s_whole = tx.update(g_tree, s_whole, whole)
            want = np.concatenate([np.asarray(u_whole["b"]), np.asarray(u_whole["w"]).ravel()])
            got = []
            for i, (lo, hi) in enumerate(cuts):
                (u,), s_pieces[i] = tx.update([jnp.asarray(g[lo:hi])], s_pieces[i], [pieces[i]])
                got.append(np.asarray(u))
            diff = np.abs(np.concatenate(got) - want)
            if not np.all(diff <= 1e-6 * np.abs(want) + 1e-30):
                raise ConfigError(
                    f"optax transformation {_name(tx)} is not elementwise: its update of a shard "
                    f"differs from its update of the whole parameters (max difference "
                    f"{float(np.nanmax(diff))} at step {t + 1}); ZeroOptimizer shards the "
                    "optimizer state across ranks, which is exact only for elementwise "
                    "transformations (optax.adam/adamw/sgd/..., schedules). Use DDP "
                    "(DistributedGradReducer) with the unsharded transformation instead"
                )
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"optax transformation {_name(tx)} failed on flat float32 shards "
            f"({type(e).__name__}: {e}); ZeroOptimizer needs an elementwise "
            "transformation of a list of 1-D arrays"
        ) from e


def check_transformation(tx: optax.GradientTransformation, owner: str) -> None:
    """`tx` must be an optax transformation (ConfigTypeError) and elementwise (ConfigError)."""
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise ConfigTypeError(f"{owner} needs an optax GradientTransformation, got {type(tx).__name__}")
    check_elementwise(tx)


def _name(tx: optax.GradientTransformation) -> str:
    return getattr(getattr(tx, "update", None), "__qualname__", type(tx).__name__)


class ZeroOptimizer:
    """An optax transformation over this rank's flat float32 shards (see the module doc).
    `params`: the pytree of jax.Arrays the transformation optimizes, equal on every rank after
    construction (rank 0's values are broadcast). Low-precision parameters get float32 masters."""

    def __init__(
        self,
        params: Pytree,
        tx: optax.GradientTransformation,
        *,
        group: Optional[ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
    ) -> None:
        import jax

        check_transformation(tx, "ZeroOptimizer")
        self.tx = tx
        self.group = group if group is not None else get_world_group()
        self.device = device_of(self.group)
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        if not leaves:
            raise ConfigError("ZeroOptimizer: params has no leaves")
        self._jax_devices = [next(iter(x.devices())) for x in leaves]
        xp = self.device.xp
        natives = [xp.array(to_native(x)) for x in leaves]  # writable copies, ours
        for x in natives:
            broadcast(x, 0, self.group)
        # the same validated config and factory as the torch forms; the core holds its own
        # grad buckets (JAX hands the grads over whole, after backward)
        self.shard_core = build_core(
            ZeroConfig(stage=2, bucket_cap_mb=bucket_cap_mb), natives, self.group, self.device
        )
        self.shard_memory = self.shard_core.shard_memory
        self._reduce, self._pool = self.shard_core.reduce, self.shard_core.pool

    def init(self, params: Pytree) -> optax.OptState:
        """The optax state of this rank's shards (a list of flat float32 arrays, one per
        bucket)."""
        self._check_tree(params, "params")
        return self.tx.init(self._master_jax())

    def step(self, params: Pytree, grads: Pytree, state: optax.OptState) -> Tuple[Pytree, optax.OptState]:
        """(new params, new state): the mean of every rank's `grads` applied by the optax
        transformation to this rank's shards, the parameters all-gathered. `params` are the
        ones returned by the previous step (or given to the constructor)."""
        import jax
        import optax

        self._check_tree(params, "params")
        self._check_tree(grads, "grads")
        natives = [to_native(g) for g in jax.tree_util.tree_leaves(grads)]
        assert self._reduce is not None and self._pool is not None  # stage 2, the core's pool
        for b, bucket in enumerate(self.shard_memory.layout.buckets):
            buf = self._pool.buffer(b)  # one buffer reused: no full-size grad copy is kept
            kernels.pack([natives[i] for i in bucket.params], buf, list(bucket.offsets))
            self._reduce.reduce(b, buf, ReduceOp.AVG, f"grad bucket {b}")
        self.shard_memory.collect_reduced()
        self.device.current_stream().synchronize()
        master = self._master_jax()
        shard_grads = [
            from_native(self.device.xp.array(g), self._jax_devices[0]) for g in self.shard_memory.grads
        ]
        updates, state = self.tx.update(shard_grads, state, master)
        new = optax.apply_updates(master, updates)
        for m, x in zip(self.shard_memory.master, new):
            m[...] = to_native(x)
        self.shard_memory.gather(wait=True)
        out = [
            from_native(self.device.xp.array(p), d)
            for p, d in zip(self.shard_memory.params, self._jax_devices)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, out), state

    def close(self) -> None:
        self.shard_core.close()

    def _master_jax(self) -> List[jax.Array]:
        return [from_native(self.device.xp.array(m), self._jax_devices[0]) for m in self.shard_memory.master]

    def _check_tree(self, tree: Pytree, what: str) -> None:
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ConfigError(
                f"ZeroOptimizer.step: {what} has structure {treedef}, the optimizer "
                f"was built for {self.treedef}; pass the same pytree structure"
            )
        for i, (x, p) in enumerate(zip(leaves, self.shard_memory.params)):
            if tuple(x.shape) != tuple(p.shape):
                raise ConfigError(
                    f"ZeroOptimizer.step: {what} leaf {i} has shape "
                    f"{tuple(x.shape)}, the parameter has {tuple(p.shape)}"
                )


class OptaxShardState:
    """One flat shard's optax state (optax's functional state, replaced at every step)."""

    def __init__(self, opt_state: optax.OptState) -> None:
        self.opt_state = opt_state

    @property
    def buffers(self) -> dict:
        """The state's arrays by leaf index (what `ShardedParams.state_nbytes` counts)."""
        import jax

        return dict(enumerate(jax.tree_util.tree_leaves(self.opt_state)))


class ShardOptax:
    """An elementwise optax transformation as a flat-shard optimizer (`nd.ShardedParams`'s, the
    interface of nd.ShardSGD / nd.ShardAdamW): each float32 shard gets its own optax state and
    is updated in place. Refused (`ConfigError`) unless the transformation is elementwise (the
    probe of `ZeroOptimizer`); the learning rate lives in the transformation (a schedule)."""

    def __init__(self, tx: optax.GradientTransformation) -> None:
        check_transformation(tx, "ShardOptax")
        self.tx = tx

    def init_state(self, master: np.ndarray) -> OptaxShardState:
        return OptaxShardState(self.tx.init([from_native(np.array(master))]))

    def step(
        self,
        master: np.ndarray,
        grad: np.ndarray,
        state: OptaxShardState,
        params_out: Optional[np.ndarray] = None,
        *,
        grad_scale: float = 1.0,
        lr: Optional[float] = None,
    ) -> None:
        """One optax update of `master` in place from `grad * grad_scale`; `params_out` (the
        low-precision copy of the shard, or None) := the new master cast."""
        import optax

        if lr is not None:
            raise ConfigError("ShardOptax.step: lr= is not supported; give optax a schedule instead")
        if not isinstance(state, OptaxShardState):
            raise ConfigTypeError(
                f"ShardOptax.step: state must be init_state(master)'s, got {type(state).__name__}"
            )
        g = np.asarray(grad, np.float32) * np.float32(grad_scale) if grad_scale != 1.0 else np.array(grad)
        m = from_native(np.array(master))  # copies: the master is written below
        updates, state.opt_state = self.tx.update([from_native(g)], state.opt_state, [m])
        master[...] = to_native(optax.apply_updates([m], updates)[0])
        if params_out is not None:
            params_out[...] = master.astype(params_out.dtype)
