"""Sharding is one layer, chosen when the model is built: one factory (zero/core.py) assembles the
shard core for every form, ZeRO-2 happens only when the model was built with
`zero=ZeroConfig(stage=2)`, the optimizer follows the model (or says exactly how to build it), and
a frozen parameter among `model.parameters()` is skipped as torch's class skips it (2 ranks
against torch DDP + the unsharded optimizer)."""

from __future__ import annotations

import ast
import functools

import numpy as np
import pytest
from mp import run_ranks
from paths import ROOT

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, ConfigTypeError

CORE = "nccl_ddp/zero/core.py"


@functools.cache
def _all_calls() -> tuple:
    """(called name, module path, line) of every call in the package."""
    out = []
    for path in sorted((ROOT / "nccl_ddp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                out.append((called, path.relative_to(ROOT).as_posix(), node.lineno))
    return tuple(out)


def _calls(name: str):
    return [(path, line) for called, path, line in _all_calls() if called == name]


@pytest.mark.slow  # parses the whole package (2-3 s under load)
def test_the_shard_core_is_assembled_in_one_place():
    """torch ZeRO-1/2, JAX and arrays all get their core from zero/core.py's factory."""
    for name in ("ZeroShards", "ReduceScatter", "shard_layout"):
        places = sorted({path for path, _ in _calls(name)})
        assert places == [CORE], f"{name} built outside the factory: {_calls(name)}"


def test_the_reducer_stays_under_450_lines():
    """Its per-step state, bucket memory, closing collectives and shard core live beside it."""
    n = len((ROOT / "nccl_ddp/ddp/reducer.py").read_text().splitlines())
    assert n < 450, f"nccl_ddp/ddp/reducer.py has {n} lines"


# ---------------------------------------------------------------------------------- one rank


@pytest.fixture
def world1(monkeypatch):
    from zero_oracle import host_alone

    with host_alone(monkeypatch):
        yield


def _model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))


@pytest.mark.slow  # imports torch
def test_the_model_is_validated_when_built(world1):
    with pytest.raises(ConfigTypeError, match="zero must be None or nccl_ddp.ZeroConfig"):
        nd.DistributedDataParallel(_model(), zero=2)
    with pytest.raises(ConfigError, match="pass bucket_cap_mb to DistributedDataParallel"):
        nd.DistributedDataParallel(_model(), zero=nd.ZeroConfig(stage=2, bucket_cap_mb=1))
    with pytest.raises(ConfigError, match="rank 0: .*static_graph=True"):
        nd.DistributedDataParallel(_model(), zero=nd.ZeroConfig(stage=2), static_graph=True)


@pytest.mark.slow  # the first torch optimizer of a process imports torch._dynamo
def test_zero2_only_when_the_model_asks_for_it(world1):
    import torch

    from nccl_ddp.zero.core import ShardCore

    m = _model()
    plain = nd.DistributedDataParallel(m)
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    assert opt._stage == 1 and plain.reducer.shard_core is None and plain.reducer.sharding is None
    assert isinstance(opt.shard_core, ShardCore) and opt.shard_core.reduce is None  # the factory's, ZeRO-1
    opt.zero_grad()
    plain(torch.ones(3, 5)).square().sum().backward()
    full = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert all(g.abs().sum() > 0 for g in full.values())  # torch's contract: the whole grad
    plain.close()

    m = _model()
    sharded = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
    core = sharded.reducer.shard_core
    assert isinstance(core, ShardCore) and core.reduce is sharded.reducer.submitter.collective
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    assert opt._stage == 2 and opt.shard_core is core  # found through the parameters' mark
    with pytest.raises(
        ConfigError, match=r"zero_stage=1, but the model was built with zero=ZeroConfig\(stage=2\)"
    ):
        nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, zero_stage=1)
    with pytest.raises(ConfigError, match="overlap_param_gather=True differs from the model's"):
        nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, overlap_param_gather=True)
    sharded.close()

    m = _model()  # stage 1 asked on the model: it builds the core, all-reduces whole grads
    one = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=1))
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    assert opt._stage == 1 and opt.shard_core is one.reducer.shard_core and one.reducer.sharding is None
    before = [p.detach().clone() for p in m.parameters()]
    opt.zero_grad()
    one(torch.ones(3, 5)).square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    for b, g, p in zip(before, grads, m.parameters()):
        torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=1e-6, atol=1e-6)  # SGD, 1 rank
    one.close()

    with pytest.raises(
        ConfigError, match=r"DistributedDataParallel\(module, zero=nccl_ddp.ZeroConfig\(stage=2\)\)"
    ):
        nd.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1, zero_stage=2)


@pytest.mark.slow  # JAX compiles the elementwise probe
def test_jax_uses_the_same_factory_and_config(world1):
    pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    from nccl_ddp.zero.core import ShardCore

    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    zopt = nd.ZeroOptimizer(params, optax.sgd(0.1))
    assert (
        isinstance(zopt.shard_core, ShardCore)
        and zopt.shard_core.stage == 2
        and zopt.shard_core.reduce is not None
    )
    zopt.close()
    # several buckets: their grads pass through one pooled bucket buffer, none kept full size
    zopt = nd.ZeroOptimizer(params, optax.sgd(0.1), bucket_cap_mb=32 / 2**20)
    buckets = zopt.shard_core.shards.layout.buckets
    assert len(buckets) > 1 and zopt.shard_core.grad_memory is None
    assert zopt.shard_core.pool.nbytes == max(b.nbytes for b in buckets) < sum(b.nbytes for b in buckets)
    grads = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.full(4, 2.0)}
    state = zopt.init(params)
    for _ in range(2):  # the second step reuses the pool: stale values must not leak in
        params, state = zopt.step(params, grads, state)
    zopt.close()
    np.testing.assert_allclose(np.asarray(params["w"]), 1 - 0.2 * np.arange(12.0).reshape(3, 4), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(params["b"]), np.full(4, -0.4), rtol=1e-6)
    for bad in (-1, float("inf")):
        with pytest.raises(ConfigError, match=r"bucket_cap_mb must be a finite number > 0 MiB"):
            nd.ZeroOptimizer(params, optax.sgd(0.1), bucket_cap_mb=bad)


# ---------------------------------------------------------------------------------- two ranks


def _frozen(rank: int, world: int, store_dir: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from zero_oracle import OPTIMIZERS, gloo_and_host, make_model, train

    with gloo_and_host(rank, world, store_dir):
        cls_name, kw = OPTIMIZERS["adamw"]
        cls = getattr(torch.optim, cls_name)

        def frozen_model():
            m = make_model()
            m.b.weight.requires_grad_(False)  # inside model.parameters(), never trained
            return m

        out = {}
        m = frozen_model()
        out["reference"] = train(m, cls(m.parameters(), **kw), TorchDDP(m), rank, world)
        m = frozen_model()
        out["zero1"] = train(
            m, nd.ZeroRedundancyOptimizer(m.parameters(), cls, **kw), TorchDDP(m), rank, world
        )
        m = frozen_model()
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=400 / 2**20, zero=nd.ZeroConfig(stage=2))
        z = nd.ZeroRedundancyOptimizer(m.parameters(), cls, **kw)
        out["zero2"] = train(m, z, ddp, rank, world)
        out["zero2_stage"] = z._stage
        ddp.close()
    return out


@pytest.mark.slow
def test_a_frozen_parameter_is_skipped_as_torch_skips_it(tmp_path):
    """Before: ZeRO-2 refused model.parameters() with a frozen one ("not covered by the same
    wrapper")."""
    pytest.importorskip("torch")
    results = run_ranks(_frozen, 2, str(tmp_path), timeout=170)
    for rank, res in enumerate(results):
        assert res["zero2_stage"] == 2
        ref = res["reference"]
        for case in ("zero1", "zero2"):
            assert set(res[case]) == set(ref)
            for n in ref:
                np.testing.assert_allclose(
                    res[case][n], ref[n], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {case} {n}"
                )
        untouched = make_b_weight()
        np.testing.assert_array_equal(res["zero2"]["b.weight"], untouched)


def make_b_weight():
    """The frozen parameter's initial value (it must never move)."""
    from zero_oracle import make_model

    return make_model().b.weight.detach().numpy()


def test_the_global_norm_is_one_host_read_per_step(world1, monkeypatch):
    """The shards' squared norms are summed on the device: one read of the all-reduced sum
    however many buckets (before: one per bucket, then one more)."""
    from nccl_ddp.comm.api import device_of, get_world_group
    from nccl_ddp.zero import shards as shards_mod
    from nccl_ddp.zero.core import build_core

    group = get_world_group()
    device = device_of(group)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(40,), (30, 3), (50,), (7,)]]
    core = build_core(nd.ZeroConfig(stage=1, bucket_cap_mb=200 / 2**20), params, group, device)
    assert len(core.shard_memory.layout.buckets) >= 3
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    core.shard_memory.collect_full(grads)
    reads = []
    real = shards_mod.to_host
    monkeypatch.setattr(shards_mod, "to_host", lambda x: reads.append(1) or real(x))
    norm = core.shard_memory.global_norm()
    core.close()
    want = np.sqrt(sum(float(np.dot(g.ravel().astype(np.float64), g.ravel())) for g in grads))
    assert norm == pytest.approx(want, rel=1e-6)
    assert len(reads) == 1
