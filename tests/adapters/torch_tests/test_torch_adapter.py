"""The PyTorch adapter against torch's own DDP (gloo, CPU, 2 ranks, different data per rank).

Each rank trains tests/support/torch_oracle.py's tied-weight / unused-branch model twice: once wrapped in
`torch.nn.parallel.DistributedDataParallel` on gloo, once in ours on the host backend; after
several SGD-with-momentum steps the parameters must agree to float32 rounding.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from paths import ROOT  # noqa: E402
from torch_oracle import OracleConfig, batches, gloo_group, make_model, run_torch_ddp, train  # noqa: E402

WORLD = 2
CONFIGS = {
    "unused-branch": OracleConfig(),
    "no_sync-accumulate": OracleConfig(accumulate=2),
    "static_graph": OracleConfig(static_graph=True),
    "static_graph-no_sync": OracleConfig(accumulate=2, static_graph=True),
    "branch-unused-on-one-rank": OracleConfig(branch_by_rank=True),
}
# name -> (config, extra DDP kwargs); PythonReducer: one all-reduce per grad, grads not views
CASES = {name: (config, {}) for name, config in CONFIGS.items()}
CASES["PythonReducer-no_sync"] = (
    CONFIGS["no_sync-accumulate"],
    {"reducer_mode": "PythonReducer", "bucket_cap_mb": 0},
)


def _ours_and_torch(rank: int, world: int, cases: dict, store_dir: str) -> dict:
    """Every case in one process pair (spawning costs more than training this model)."""
    import nccl_ddp as nd

    torch.set_num_threads(1)
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        references = {name: run_torch_ddp(rank, config) for name, (config, _) in cases.items()}
    out = {}
    nd.init_process_group("host")
    try:
        for name, (config, ddp_kwargs) in cases.items():
            module = make_model(rank)
            ddp = nd.DistributedDataParallel(
                module,
                find_unused_parameters=config.find_unused_parameters,
                static_graph=config.static_graph,
                **ddp_kwargs,
            )
            ours = train(ddp, module, rank, config)
            grad_is_none = {n: p.grad is None for n, p in module.named_parameters()}
            ddp.close()
            out[name] = (references[name], ours, grad_is_none)
    finally:
        nd.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def oracle_results(tmp_path_factory):
    return run_ranks(_ours_and_torch, WORLD, CASES, str(tmp_path_factory.mktemp("gloo")), timeout=150)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_ddp(name, oracle_results):
    for rank, results in enumerate(oracle_results):
        reference, ours, grad_is_none = results[name]
        assert set(ours) == set(reference)
        for key in reference:
            np.testing.assert_allclose(
                ours[key], reference[key], rtol=1e-6, atol=1e-7, err_msg=f"rank {rank} {name}: {key}"
            )
        # the models were built different on every rank: equality means rank 0's won
        assert not np.array_equal(
            reference["hidden.weight"], make_model(1 - rank).hidden.weight.detach().numpy()
        )
        # torch semantics: after optimizer.zero_grad() every .grad is None again
        assert all(grad_is_none.values()), grad_is_none
    np.testing.assert_array_equal(
        oracle_results[0][name][1]["embed.weight"], oracle_results[1][name][1]["embed.weight"]
    )


def _grads_are_bucket_views(rank: int, world: int) -> dict:
    import nccl_ddp as nd
    from nccl_ddp.ddp.data_parallel import DistributedDataParallel

    nd.init_process_group("host")
    try:
        module = make_model(rank)
        ddp = DistributedDataParallel(module)
        x, y = batches(rank, OracleConfig())[0]
        torch.nn.functional.mse_loss(ddp(x, use_branch=True), y).backward()
        buffers = ddp.reducer.memory.buffers
        starts = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers]
        inside = all(any(lo <= p.grad.data_ptr() < hi for lo, hi in starts) for p in module.parameters())
        grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
        ddp.zero_grad(set_to_none=False)  # torch's zero_grad: in place, in the buckets
        zeroed = all(float(p.grad.abs().sum()) == 0.0 for p in module.parameters())
        ddp.zero_grad()  # torch's default: set_to_none
        zeroed = zeroed and all(p.grad is None for p in module.parameters())
        ddp.close()
    finally:
        nd.destroy_process_group()
    return {"inside": inside, "grads": grads, "zeroed": zeroed, "scale": module.scale.numpy().copy()}


@pytest.mark.slow
def test_grads_alias_buckets_and_are_averaged():
    r0, r1 = run_ranks(_grads_are_bucket_views, WORLD, timeout=60)
    assert r0["inside"] and r1["inside"], "p.grad must be a view of the bucket memory"
    assert r0["zeroed"] and r1["zeroed"]
    np.testing.assert_array_equal(r0["scale"], r1["scale"])  # buffer broadcast from rank 0
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
    from nccl_ddp.ddp.grad_reducer import DistributedGradReducer

    nd.init_process_group("host")
    try:
        module = make_model(0)
        x, y = batches(rank, OracleConfig())[0]
        torch.nn.functional.mse_loss(module(x, use_branch=True), y).backward()
        reducer = DistributedGradReducer(module.parameters())
        grads = [p.grad for p in module.parameters()]
        out = reducer(grads)
        assert isinstance(out, list) and all(isinstance(g, torch.Tensor) for g in out)
        result = [
            (tuple(g.shape), g.dtype, g.numpy().copy(), p.grad.numpy().copy())
            for g, p in zip(out, module.parameters())
        ]
        reducer.close()
    finally:
        nd.destroy_process_group()
    return result


@pytest.mark.slow
def test_grad_reducer_on_tensors():
    r0, r1 = run_ranks(_grad_reducer, WORLD, timeout=60)
    for (shape, dtype, g0, local0), (_, _, g1, local1) in zip(r0, r1):
        assert dtype == torch.float32 and g0.shape == shape
        np.testing.assert_allclose(g0, (local0 + local1) / 2, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(g0, g1)


@pytest.mark.slow
def test_bench_ddp_torch_mode(tmp_path):
    """scripts/bench_ddp.py --torch runs end to end and reports ours vs torch DDP as a ratio."""
    import csv
    import subprocess
    import sys

    script = os.path.join(ROOT, "scripts", "bench_ddp.py")
    out = tmp_path / "bench.csv"
    r = subprocess.run(
        [
            sys.executable,
            script,
            "--modes",
            "",
            "--torch",
            "--caps",
            "0.01",
            "--hidden",
            "32",
            "--layers",
            "2",
            "--features",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--profile-steps",
            "1",
            "--csv",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, NCCL_DDP_NO_PROGRESS="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = list(csv.DictReader(open(out)))
    assert row["mode"] == "torch" and row["backend"] == "host/gloo"
    assert float(row["torch_ddp_ms"]) > 0 and float(row["ddp_ms"]) > 0
    assert abs(float(row["ratio"]) - float(row["ddp_ms"]) / float(row["torch_ddp_ms"])) < 1e-6


def _torch_on_gpu(rank: int, world: int) -> tuple:
    import nccl_ddp as nd

    config = OracleConfig(accumulate=2)
    nd.init_process_group("nccl", timeout=60.0)
    try:
        local = make_model(0).cuda()
        ref = train(_NoDDP(local), local, rank, config, device="cuda")
        module = make_model(0).cuda()
        # torch's single-GPU spelling: device_ids=[this GPU] (inputs are moved there, as torch does)
        ddp = nd.DistributedDataParallel(
            module, find_unused_parameters=True, device_ids=[torch.cuda.current_device()]
        )
        ours = train(ddp, module, rank, config, device="cuda")
        x, y = batches(rank, config)[0]
        torch.nn.functional.mse_loss(ddp(x.cuda()), y.cuda()).backward()
        spans = [(b.data.ptr, b.data.ptr + b.nbytes) for b in ddp.reducer.memory.buffers]
        inside = all(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in module.parameters())
        ddp.close()
    finally:
        nd.destroy_process_group()
    return ref, ours, inside


class _NoDDP:
    """The training loop's view of a plain module (no_sync does nothing)."""

    def __init__(self, module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return contextlib.nullcontext()


@pytest.mark.gpu
def test_torch_on_gpu_world_of_one():
    """CUDA path (NCCL, CuPy kernels, torch's current stream as the compute stream): with one
    rank the mean is the local grad, so training must match training without DDP."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (the CPU wheel)")
    ref, ours, inside = run_ranks(_torch_on_gpu, 1, timeout=300)[0]
    assert inside, "p.grad must be a view of the bucket memory"
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
