"""JAX + optax on sharded optimizer state and grads (nd.ZeroOptimizer, ZeRO-2): 2 ranks with
their own grads end where unsharded optax ends on the mean grads; non-elementwise transformations
are refused."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install jax jaxlib)")
optax = pytest.importorskip("optax", reason="optax is not installed")

from mp import run_ranks  # noqa: E402

import nccl_ddp as nd  # noqa: E402
from nccl_ddp.adapters.jax.zero import check_elementwise  # noqa: E402
from nccl_ddp.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow  # JAX compiles each op of the probe and the steps (3-25 s here)
STEPS = 5


def _params():
    """Uneven leaves (shards cut through them), float32 and bfloat16."""
    rng = np.random.default_rng(0)
    import jax.numpy as jnp

    return {
        "w1": jnp.asarray(rng.standard_normal((37, 23)).astype(np.float32)),
        "b1": jnp.asarray(rng.standard_normal(23).astype(np.float32)),
        "w2": jnp.asarray(rng.standard_normal((23, 5)).astype(np.float32)),
        "e": jnp.asarray(rng.standard_normal(11).astype(np.float32)),
    }


def _grads(rank, step):
    import jax.numpy as jnp

    rng = np.random.default_rng([rank, step])
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), _params()
    )


def _tx(kind):
    if kind == "adamw":
        return optax.adamw(1e-2, b1=0.9, b2=0.99, weight_decay=0.1)
    return optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.1, momentum=0.9))


def _rank(rank, world, kind, cap_mb):
    nd.init_process_group("host")
    try:
        params = _params()
        zopt = nd.ZeroOptimizer(params, _tx(kind), bucket_cap_mb=cap_mb)
        state = zopt.init(params)
        for step in range(STEPS):
            params, state = zopt.step(params, _grads(rank, step), state)
        nbuckets = len(zopt.shard_memory.master)
        shard = sum(m.size for m in zopt.shard_memory.master)
        assert sum(g.size for g in zopt.shard_memory.grads) == shard  # only the owned grad slices kept
        zopt.close()
        return jax.tree_util.tree_map(np.asarray, params), nbuckets, shard
    finally:
        nd.destroy_process_group()


def _unsharded(kind, world):
    tx = _tx(kind)
    params = _params()
    state = tx.init(params)
    for step in range(STEPS):
        per_rank = [_grads(r, step) for r in range(world)]
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / world, *per_rank)
        updates, state = tx.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree_util.tree_map(np.asarray, params)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_two_ranks_equal_unsharded_optax(kind):
    """Several buckets (a 0.001 MiB cap), each cut in two shards through parameters: every rank's
    parameters after 5 steps equal unsharded optax on the mean grads to 1e-6."""
    results = run_ranks(_rank, 2, kind, 0.001, timeout=120)
    want = _unsharded(kind, 2)
    total = sum(x.size for x in jax.tree_util.tree_leaves(want))
    for params, nbuckets, shard in results:
        assert nbuckets >= 2 and shard < total  # sharded: each rank holds about half
        for got, ref in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(results[0][0]), jax.tree_util.tree_leaves(results[1][0])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "tx",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        lambda: optax.lamb(1e-3),
        lambda: optax.adamw(
            1e-3, weight_decay=0.1, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)
        ),
    ],
    ids=["clip_by_global_norm", "lamb", "adamw-mask-by-ndim"],
)
def test_non_elementwise_transformations_are_refused(tx):
    with pytest.raises(ConfigError, match="is not elementwise"):
        check_elementwise(tx())


@pytest.mark.parametrize(
    "tx",
    [
        lambda: optax.adamw(1e-3),
        lambda: optax.sgd(0.1, momentum=0.9),
        lambda: optax.adam(optax.linear_schedule(1e-3, 1e-4, 10)),
    ],
    ids=["adamw", "sgd-momentum", "adam-schedule"],
)
def test_elementwise_transformations_pass_the_probe(tx):
    check_elementwise(tx())
