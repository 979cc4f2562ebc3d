"""The NumPy path of ZeRO end to end: the shard core (zero/core.py's factory, stage 1) with the fused
flat-shard optimizers (nd.ShardAdamW/ShardSGD, one step per bucket shard, the bfloat16 parameter
shard written in the same pass), 2 processes on the host backend, against the same optimizer run
unsharded on the summed grads: bitwise, because the update is elementwise."""

from __future__ import annotations

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(37, 23), (23,), (23, 5), (11,), (301,)]  # uneven: shards cut through parameters
STEPS = 4
WORLD = 2


def _make(kind):
    if kind == "adamw":
        return nd.ShardAdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True)
    return nd.ShardSGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _init(dtype):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32).astype(dtype) for s in SHAPES]


def _grads(rank, step):
    rng = np.random.default_rng([rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _rank(rank, world, kind, dtype):
    from nccl_ddp.comm.api import device_of, get_world_group
    from nccl_ddp.zero.core import build_core

    nd.init_process_group("host")
    try:
        group = get_world_group()
        device = device_of(group)
        params = _init(dtype)
        core = build_core(nd.ZeroConfig(stage=1, bucket_cap_mb=512 / 2**20), params, group, device)
        shard_memory = core.shard_memory
        opt = _make(kind)
        states = [opt.init_state(m) for m in shard_memory.master]
        low = np.dtype(dtype) != np.float32
        for step in range(STEPS):
            grads = _grads(rank, step)
            for g in grads:
                nd.all_reduce(g)  # sum; 1/world fused into the step
            shard_memory.collect_full(grads)
            device.current_stream().synchronize()
            for b, (m, g, s) in enumerate(zip(shard_memory.master, shard_memory.grads, states)):
                opt.step(
                    m, g, s, params_out=shard_memory.owned_params(b) if low else None, grad_scale=1 / world
                )
            shard_memory.gather(wait=True)
        device.current_stream().synchronize()
        shard_memory.close()
        return (
            [p.astype(np.float32) for p in params],
            len(shard_memory.master),
            sum(m.size for m in shard_memory.master),
        )
    finally:
        nd.destroy_process_group()


def _unsharded(kind, dtype):
    params = _init(dtype)
    master = np.concatenate([p.astype(np.float32).ravel() for p in params])
    out = np.empty(master.size, np.dtype(dtype))
    opt = _make(kind)
    state = opt.init_state(master)
    for step in range(STEPS):
        total = [sum(gs) for gs in zip(*(_grads(r, step) for r in range(WORLD)))]
        g = np.concatenate([x.ravel() for x in total])
        opt.step(master, g, state, params_out=out, grad_scale=1 / WORLD)
    ends = np.cumsum([int(np.prod(s)) for s in SHAPES])
    return [x.astype(np.float32).reshape(s) for x, s in zip(np.split(out, ends[:-1]), SHAPES)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_numpy_path_equals_the_unsharded_optimizer_bitwise(kind, dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    results = run_ranks(_rank, WORLD, kind, dt, timeout=120)
    want = _unsharded(kind, dt)
    total = sum(w.size for w in want)
    for params, nbuckets, shard in results:
        assert nbuckets >= 2 and shard < total
        for i, (got, ref) in enumerate(zip(params, want)):
            np.testing.assert_array_equal(got, ref, err_msg=f"param {i} {SHAPES[i]}")
