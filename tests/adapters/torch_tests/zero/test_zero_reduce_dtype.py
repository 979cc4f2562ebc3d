"""ZeRO-2 with reduce_dtype=torch.float32 (2 ranks, host backend, gloo for the reference): bf16
parameters whose buckets are widened and reduce-scattered in fp32 train as the unsharded reference
that all-reduces the fp32-widened local grads (fp32 masters, AdamW), and differ from the default
(grads reduced in bf16)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from zero_oracle import OPTIMIZERS, gloo_and_host, make_model, train, train_masters  # noqa: E402

WORLD = 2
SMALL = 400 / (1 << 20)


def _run(rank: int, world: int, store_dir: str) -> dict:
    import nccl_ddp as nd

    cls, kw = OPTIMIZERS["adamw"]
    out: dict = {}
    with gloo_and_host(rank, world, store_dir):
        m = make_model(torch.bfloat16)
        out["reference"] = train_masters(m, m, rank, world, "adamw", reduce_fp32=True)
        for name, reduce_dtype in (("fp32", torch.float32), ("own", None)):
            m = make_model(torch.bfloat16)
            zero = nd.ZeroConfig(stage=2, reduce_dtype=reduce_dtype)
            ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=zero)
            z = nd.ZeroRedundancyOptimizer(m.parameters(), getattr(torch.optim, cls), zero_stage=2, **kw)
            out[name] = train(m, z, ddp, rank, world, dtype=torch.bfloat16)
            outputs = ddp.reducer.sharding.outputs
            out[f"{name}_wire"] = sorted({str(o.dtype) for o in outputs})
            out[f"{name}_buckets"] = len(ddp.reducer.layout.buckets)
            out[f"{name}_no_copy"] = all(g is o for g, o in zip(z.shard_memory.grads, outputs))
            ddp.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=170)


@pytest.mark.slow
def test_fp32_reduction_matches_the_fp32_reduced_reference(results):
    for res in results:
        assert res["fp32_wire"] == ["float32"] and res["fp32_buckets"] > 1
        assert res["fp32_no_copy"]  # the fp32 reduced shard is the optimizer's grad shard
        assert set(res["fp32"]) == set(res["reference"])
        for n, ref in res["reference"].items():
            np.testing.assert_allclose(res["fp32"][n], ref, rtol=0, atol=1e-6, err_msg=n)
    for n in results[0]["fp32"]:
        np.testing.assert_array_equal(results[0]["fp32"][n], results[1]["fp32"][n], err_msg=n)


@pytest.mark.slow
def test_default_reduces_in_the_grads_dtype(results):
    """Without reduce_dtype the buckets are reduced in bf16: the same job ends elsewhere."""
    for res in results:
        assert res["own_wire"] == ["bfloat16"]
        assert any(not np.array_equal(res["own"][n], ref) for n, ref in res["reference"].items())
