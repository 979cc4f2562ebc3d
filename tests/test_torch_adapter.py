"""The PyTorch adapter against torch's own DDP (gloo, CPU, 2 ranks, different data per rank).

Each rank trains tests/torch_oracle.py's tied-weight / unused-branch model twice: once wrapped in
`torch.nn.parallel.DistributedDataParallel` on gloo, once in ours on the host backend; after
several SGD-with-momentum steps the parameters must agree to float32 rounding.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from torch_oracle import OracleConfig, batches, make_model, run_torch_ddp, train  # noqa: E402

WORLD = 2
CONFIGS = {
    "unused-branch": OracleConfig(),
    "no_sync-accumulate": OracleConfig(accumulate=2),
    "static_graph": OracleConfig(static_graph=True),
    "static_graph-no_sync": OracleConfig(accumulate=2, static_graph=True),
}


def _ours_and_torch(rank: int, world: int, config: OracleConfig, store_file: str,
                    ddp_kwargs: dict) -> tuple:
    import nccl_ddp as nd
    from nccl_ddp.ddp import DistributedDataParallel

    torch.set_num_threads(1)
    reference = run_torch_ddp(rank, world, config, store_file)
    nd.init_process_group("host")
    try:
        module = make_model(rank)
        ddp = DistributedDataParallel(module, find_unused_parameters=config.find_unused_parameters,
                                      static_graph=config.static_graph, **ddp_kwargs)
        views = sum(1 for p in module.parameters() if p.grad is not None)
        ours = train(ddp, module, rank, config)
        grad_is_none = {n: p.grad is None for n, p in module.named_parameters()}
        ddp.close()
    finally:
        nd.destroy_process_group()
    return reference, ours, grad_is_none, views


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_ddp(name, tmp_path):
    config = CONFIGS[name]
    results = run_ranks(_ours_and_torch, WORLD, config, str(tmp_path / "gloo"), {}, timeout=120)
    for rank, (reference, ours, grad_is_none, _) in enumerate(results):
        assert set(ours) == set(reference)
        for key in reference:
            np.testing.assert_allclose(ours[key], reference[key], rtol=1e-6, atol=1e-7,
                                       err_msg=f"rank {rank} {name}: {key}")
        # the models were built different on every rank: equality means rank 0's won
        assert not np.array_equal(reference["hidden.weight"],
                                  make_model(1 - rank).hidden.weight.detach().numpy())
        # torch semantics: after optimizer.zero_grad() every .grad is None again
        assert all(grad_is_none.values()), grad_is_none
    np.testing.assert_array_equal(results[0][1]["embed.weight"], results[1][1]["embed.weight"])


def test_reducer_modes_agree(tmp_path):
    """PythonReducer (one all-reduce per grad, grads not bucket views) gives torch's numbers too."""
    config = CONFIGS["no_sync-accumulate"]
    results = run_ranks(_ours_and_torch, WORLD, config, str(tmp_path / "gloo"),
                        {"reducer_mode": "PythonReducer", "bucket_cap_mb": 0}, timeout=120)
    for reference, ours, _, _ in results:
        for key in reference:
            np.testing.assert_allclose(ours[key], reference[key], rtol=1e-6, atol=1e-7)


def _grads_are_bucket_views(rank: int, world: int) -> dict:
    import nccl_ddp as nd
    from nccl_ddp.ddp import DistributedDataParallel

    nd.init_process_group("host")
    try:
        module = make_model(rank)
        ddp = DistributedDataParallel(module)
        x, y = batches(rank, OracleConfig())[0]
        torch.nn.functional.mse_loss(ddp(x, use_branch=True), y).backward()
        buffers = ddp.reducer.memory.buffers
        starts = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers]
        inside = all(any(lo <= p.grad.data_ptr() < hi for lo, hi in starts)
                     for p in module.parameters())
        grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
        ddp.zero_grad()
        zeroed = all(float(p.grad.abs().sum()) == 0.0 for p in module.parameters())
        ddp.close()
    finally:
        nd.destroy_process_group()
    return {"inside": inside, "grads": grads, "zeroed": zeroed,
            "scale": module.scale.numpy().copy()}


def test_grads_alias_buckets_and_are_averaged():
    r0, r1 = run_ranks(_grads_are_bucket_views, WORLD, timeout=60)
    assert r0["inside"] and r1["inside"], "p.grad must be a view of the bucket memory"
    assert r0["zeroed"] and r1["zeroed"]
    np.testing.assert_array_equal(r0["scale"], r1["scale"])          # buffer broadcast from rank 0
    np.testing.assert_array_equal(r0["scale"], np.ones(16, np.float32))
    # the mean of both ranks' local grads, computed here without any DDP
    local = []
    for rank in range(WORLD):
        m = make_model(0)
        x, y = batches(rank, OracleConfig())[0]
        torch.nn.functional.mse_loss(m(x, use_branch=True), y).backward()
        local.append({n: p.grad.numpy() for n, p in m.named_parameters()})
    for key in r0["grads"]:
        want = (local[0][key] + local[1][key]) / 2
        np.testing.assert_allclose(r0["grads"][key], want, rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_array_equal(r0["grads"][key], r1["grads"][key])


def _grad_reducer(rank: int, world: int) -> list:
    import nccl_ddp as nd
    from nccl_ddp.grad_reducer import DistributedGradReducer

    nd.init_process_group("host")
    try:
        module = make_model(0)
        x, y = batches(rank, OracleConfig())[0]
        torch.nn.functional.mse_loss(module(x, use_branch=True), y).backward()
        reducer = DistributedGradReducer(module.parameters())
        grads = [p.grad for p in module.parameters()]
        out = reducer(grads)
        assert isinstance(out, list) and all(isinstance(g, torch.Tensor) for g in out)
        result = [(tuple(g.shape), g.dtype, g.numpy().copy(), p.grad.numpy().copy())
                  for g, p in zip(out, module.parameters())]
        reducer.close()
    finally:
        nd.destroy_process_group()
    return result


def test_grad_reducer_on_tensors():
    r0, r1 = run_ranks(_grad_reducer, WORLD, timeout=60)
    for (shape, dtype, g0, local0), (_, _, g1, local1) in zip(r0, r1):
        assert dtype == torch.float32 and g0.shape == shape
        np.testing.assert_allclose(g0, (local0 + local1) / 2, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(g0, g1)
