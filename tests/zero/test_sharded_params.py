"""`nd.ShardedParams` (ZeRO-3 for arrays) on NumPy, 2 processes on the host backend: after
several steps of each rank's own grads the parameters equal the same fused optimizer run
unsharded on the mean grads, and our ZeRO-2 core (the same reduce-scatter, the same kernels),
bit for bit, on both ranks; uneven dim-0 sizes, several units, bfloat16 leaves; a rank holds
1/world of the parameters and state; bad input is refused before any data moves, on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, ConfigTypeError, RankMismatchError

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
WORLD = 2
STEPS = 4
# uneven dim 0 (37, 23 and 5 rows over 2 ranks are padded; (1, 4) leaves rank 1 nothing)
SHAPES = {"w1": (37, 23), "b1": (23,), "w2": (5, 7), "b2": (1, 4), "e": (301,)}
UNITS = [["w1", "b1"], ["w2"], ["b2", "e"]]


def _opt(kind):
    if kind == "adamw":
        return nd.ShardAdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    return nd.ShardSGD(lr=0.1, momentum=0.9, weight_decay=1e-3)


def _init(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32).astype(dtype) for k, s in SHAPES.items()}


def _grads(rank, step):
    rng = np.random.default_rng([rank, step])
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _train(rank, world, kind, dtype, units):
    nd.init_process_group("host")
    try:
        sp = nd.ShardedParams(_init(dtype, seed=rank), _opt(kind), units=units)  # rank 0's broadcast
        first = sp.gather()
        for step in range(STEPS):
            full = sp.gather() if step % 2 else dict(zip(SHAPES, _by_units(sp)))
            assert all(full[k].shape == s for k, s in SHAPES.items())
            sp.step(_grads(rank, step))
        out = sp.gather()
        memory = (sp.shard_nbytes, sp.state_nbytes, sp.scratch.nbytes, len(sp.units))
        sp.close()
        return first, out, memory
    finally:
        nd.destroy_process_group()


def _by_units(sp):
    """The leaves unit by unit (each gather_unit prefetching the next), in SHAPES order."""
    got = {}
    for u, unit in enumerate(sp.units):
        for i, x in zip(unit.leaves, sp.gather_unit(u)):
            got[i] = x
    return [got[i] for i in range(len(SHAPES))]


def _unsharded(kind, dtype, world=WORLD):
    """The same optimizer over all leaves as one flat float32 array, on the mean grads."""
    init = _init(dtype)
    master = np.concatenate([p.astype(np.float32).ravel() for p in init.values()])
    low = np.empty(master.size, dtype) if np.dtype(dtype) != np.float32 else None
    opt = _opt(kind)
    state = opt.init_state(master)
    for step in range(STEPS):
        g = [_grads(r, step) for r in range(world)]
        mean = np.concatenate([(sum(x[k] for x in g) / np.float32(world)).ravel() for k in SHAPES])
        opt.step(master, mean, state, params_out=low)
    flat = master if low is None else low
    ends = np.cumsum([int(np.prod(s)) for s in SHAPES.values()])
    return {k: x.reshape(s) for (k, s), x in zip(SHAPES.items(), np.split(flat, ends[:-1]))}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("units", [None, UNITS], ids=["one-unit", "three-units"])
def test_equals_the_unsharded_optimizer_on_the_mean_grads_bitwise(kind, dtype, units):
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    results = run_ranks(_train, WORLD, kind, dt, units, timeout=120)
    want, init = _unsharded(kind, dt), _init(dt, seed=0)
    for rank, (first, out, _) in enumerate(results):
        for k in SHAPES:
            assert out[k].dtype == dt
            np.testing.assert_array_equal(first[k], init[k], err_msg=f"rank {rank} {k}: not rank 0's")
            np.testing.assert_array_equal(out[k], want[k], err_msg=f"rank {rank} {k}")
            assert not np.array_equal(out[k], init[k]), k


@pytest.mark.slow
def test_three_ranks_equal_the_unsharded_optimizer():
    """3 ranks (37 rows cut 13/13/11, (1, 4) held by rank 0 alone): to 1e-6, since the ring may
    add the three grads in another order than the reference."""
    results = run_ranks(_train, 3, "adamw", np.dtype(np.float32), UNITS, timeout=180)
    want = _unsharded("adamw", np.float32, world=3)
    for rank, (_, out, _) in enumerate(results):
        for k in SHAPES:
            np.testing.assert_allclose(out[k], want[k], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {k}")
            np.testing.assert_array_equal(out[k], results[0][1][k], err_msg=f"rank {rank} {k}")


@pytest.mark.slow
def test_holds_one_world_of_parameters_and_state():
    """Shards and AdamW state are 1/world of the unsharded sizes (plus each unit's padding and
    alignment); the reduce-scatter scratch is the largest unit's full size, no more."""
    results = run_ranks(_train, WORLD, "adamw", np.dtype(np.float32), UNITS, timeout=120)
    numel = {k: int(np.prod(s)) for k, s in SHAPES.items()}
    total = 4 * sum(numel.values())
    largest = 4 * max(sum(numel[k] for k in u) for u in UNITS)
    for shards, state, scratch, nunits in (m for _, _, m in results):
        assert nunits == 3
        # per unit: rows rounded up to world (ceil) and 64-byte alignment per leaf
        slack = sum(4 * int(np.prod(s[1:])) for s in SHAPES.values()) + 64 * len(SHAPES)
        assert total / WORLD <= shards <= total / WORLD + slack, (shards, total)
        assert state == 2 * shards  # exp_avg + exp_avg_sq over the fp32 shards, no masters
        assert scratch <= largest + WORLD * (64 + slack), (scratch, largest)


def _zero2(rank, world, kind):
    """Our ZeRO-2 core (zero/core.py) with the same fused optimizer: pool, reduce-scatter (mean),
    one step per bucket shard, all-gather."""
    from nccl_ddp import kernels
    from nccl_ddp.comm.api import device_of, get_world_group
    from nccl_ddp.comm.group import ReduceOp
    from nccl_ddp.zero.core import build_core

    nd.init_process_group("host")
    try:
        group = get_world_group()
        device = device_of(group)
        params = list(_init().values())
        core = build_core(nd.ZeroConfig(stage=2, bucket_cap_mb=512 / 2**20), params, group, device)
        mem = core.shard_memory
        opt = _opt(kind)
        states = [opt.init_state(m) for m in mem.master]
        for step in range(STEPS):
            grads = list(_grads(rank, step).values())
            for b, bucket in enumerate(mem.layout.buckets):
                buf = core.pool.buffer(b)
                kernels.pack([grads[i] for i in bucket.params], buf, list(bucket.offsets))
                core.reduce.reduce(b, buf, ReduceOp.AVG, f"grad bucket {b}")
            mem.collect_reduced()
            device.current_stream().synchronize()
            for m, g, s in zip(mem.master, mem.grads, states):
                opt.step(m, g, s)
            mem.gather(wait=True)
        out = [p.copy() for p in mem.params]
        nbuckets = len(mem.master)
        core.close()
        return out, nbuckets
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_bitwise_equal_to_our_zero2(kind):
    """2 ranks: the same sum order in both reduce-scatters, the same elementwise kernels."""
    ours = run_ranks(_train, WORLD, kind, np.dtype(np.float32), UNITS, timeout=120)
    zero2 = run_ranks(_zero2, WORLD, kind, timeout=120)
    for rank in range(WORLD):
        params, nbuckets = zero2[rank]
        assert nbuckets >= 2  # ZeRO-2's buckets cut through leaves, ours cut each leaf
        for k, z in zip(SHAPES, params):
            np.testing.assert_array_equal(ours[rank][1][k], z, err_msg=f"rank {rank} {k}")


def _errors(rank, world):
    """Each bad input raises on this rank before anything is sent; afterwards the group still
    pairs every collective (a step with good grads ends equal on both ranks)."""
    nd.init_process_group("host")
    seen = {}
    try:
        params = _init()
        # shapes differ across ranks: one collective, every rank names rank 1 and the leaf
        mine = dict(params, w2=np.zeros((5, 8) if rank else (5, 7), np.float32))
        try:
            nd.ShardedParams(mine, _opt("sgd"))
        except RankMismatchError as e:
            seen["shapes"] = str(e)
        # units differ across ranks (rank 1's would be wrong alone): compared before resolved
        try:
            nd.ShardedParams(
                params, _opt("sgd"), units=[["w1", "b1", "w2", "b2"] + (["nope"] if rank else ["e"])]
            )
        except RankMismatchError as e:
            seen["units"] = str(e)
        # init="check": the values differ on rank 1
        try:
            nd.ShardedParams(_init(seed=rank), _opt("sgd"), init="check")
        except RankMismatchError as e:
            seen["values"] = str(e)
        for what, bad, kwargs in [
            ("0-dim", dict(params, s=np.float32(1.0) * np.ones((), np.float32)), {}),
            ("int", dict(params, n=np.zeros(3, np.int32)), {}),
            ("unit twice", params, {"units": [["w1", "b1"], ["w1", "w2", "b2", "e"]]}),
            ("unit missing", params, {"units": [["w1", "b1"]]}),
            ("unit unknown", params, {"units": [["w1", "b1", "w2", "b2", "e", "nope"]]}),
        ]:
            try:
                nd.ShardedParams(bad, _opt("sgd"), **kwargs)
            except ConfigError as e:
                seen[what] = str(e)
        try:
            nd.ShardedParams(params, "sgd")
        except ConfigTypeError as e:
            seen["optimizer"] = str(e)
        sp = nd.ShardedParams(params, _opt("sgd"), units=UNITS)
        good = _grads(rank, 0)
        for what, bad in [
            ("grads list", list(good.values())),
            ("grads keys", {k: good[k] for k in reversed(SHAPES)}),
            ("grads missing", {k: v for k, v in good.items() if k != "e"}),
            ("grads shape", dict(good, w1=np.zeros((23, 37), np.float32))),
        ]:
            try:
                sp.step(bad)
            except ConfigError as e:
                seen[what] = str(e)
        sp.step(good)
        out = sp.gather()
        sp.close()
        return seen, out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_bad_input_refused_on_every_rank_before_data_moves():
    results = run_ranks(_errors, WORLD, timeout=120)
    for rank, (seen, _) in enumerate(results):
        assert "shapes" in seen and "rank 1" in seen["shapes"] and "'w2'" in seen["shapes"], seen
        assert f"rank {rank}:" in seen["shapes"] and "(5, 8)" in seen["shapes"], seen["shapes"]
        assert "units" in seen["units"] and "'nope'" in seen["units"] and f"rank {rank}:" in seen["units"], (
            seen
        )
        assert "value digest of parameter 0" in seen["values"] and "rank 1" in seen["values"], seen
        assert "'s'" in seen["0-dim"] and "no dimensions" in seen["0-dim"], seen
        assert "'n'" in seen["int"] and "int32" in seen["int"], seen
        assert "'w1' is in units[0] and units[1]" in seen["unit twice"], seen
        assert "'w2'" in seen["unit missing"] and "no unit" in seen["unit missing"], seen
        assert "'nope'" in seen["unit unknown"], seen
        assert "shard optimizer" in seen["optimizer"], seen
        assert "must be a dict" in seen["grads list"] and "must be a dict" in seen["grads keys"], seen
        assert "must be a dict" in seen["grads missing"], seen
        assert seen["grads list"].startswith(f"rank {rank}: ShardedParams.step: grads must be"), seen
        assert "'w1'" in seen["grads shape"] and "(23, 37)" in seen["grads shape"], seen
        assert f"rank {rank}" in seen["grads shape"], seen
    for k in SHAPES:  # the group survived the refusals: the good step paired up
        np.testing.assert_array_equal(results[0][1][k], results[1][1][k], err_msg=k)


def _prefetch(rank, world):
    nd.init_process_group("host")
    try:
        sp = nd.ShardedParams(_init(), _opt("adamw"), units=UNITS)
        first = sp.gather_unit(0)
        prefetched = sp.units[1].pending is not None and sp.units[2].pending is None
        sp.step(_grads(rank, 0))  # drops the prefetched (old) gather of unit 1
        dropped = all(u.pending is None for u in sp.units)
        after = [sp.gather_unit(u, prefetch=False) for u in range(3)]
        whole = sp.gather()
        sp.close()
        return first, prefetched, dropped, after, whole
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_gather_unit_prefetches_the_next_and_a_step_drops_stale_gathers():
    init = _init()
    for first, prefetched, dropped, after, whole in run_ranks(_prefetch, WORLD, timeout=120):
        assert prefetched and dropped
        np.testing.assert_array_equal(first[0], init["w1"])
        for u, names in enumerate(UNITS):
            for name, x in zip(names, after[u]):
                np.testing.assert_array_equal(x, whole[name])
                assert not np.array_equal(x, init[name]), name  # the updated values, not stale


def _keeps_no_full_copy(rank, world):
    import gc
    import weakref

    nd.init_process_group("host")
    try:
        params = _init()
        refs = {k: weakref.ref(v) for k, v in params.items()}
        sp = nd.ShardedParams(params, _opt("adamw"), units=UNITS)
        del params
        gc.collect()
        alive = sorted(k for k, r in refs.items() if r() is not None)
        sp.close()
        return alive
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_keeps_no_reference_to_the_full_parameters():
    """Once built, a rank holds only its shards: the caller's full arrays can be freed."""
    assert run_ranks(_keeps_no_full_copy, WORLD, timeout=60) == [[], []]
