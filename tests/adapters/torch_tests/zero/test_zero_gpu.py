"""ZeRO-2 on one GPU over NCCL (world size 1: NCCL refuses two ranks on one device): the CUDA
path of the shard core (CuPy flat buffers as torch CUDA parameters, fp32 master shards, the
reduce-scatter and the in-place all-gather through NCCL, the global norm for clipping) trains
as torch's unsharded AdamW on the same GPU does. Prepared on a machine without a GPU: not run
there."""

import numpy as np
import pytest
from mp import run_ranks

pytestmark = pytest.mark.gpu


def _train_on_gpu(rank: int, world: int) -> dict:
    import torch
    from zero_oracle import OPTIMIZERS, make_model, train

    import nccl_ddp as nd

    nd.init_process_group("nccl", timeout=60.0)
    cls, kw = OPTIMIZERS["adamw"]
    adamw = getattr(torch.optim, cls)
    out = {}
    try:

        def on_gpu(m):
            return m.cuda()

        def cpu_params(m):
            return {n: p.detach().float().cpu().numpy() for n, p in m.named_parameters()}

        ref = on_gpu(make_model())
        train_gpu(ref, adamw(ref.parameters(), **kw), ref, train, clip=0.05)
        m = on_gpu(make_model())
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=400 / 2**20, zero=nd.ZeroConfig(stage=2))
        z = nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
        train_gpu(m, z, ddp, train, clip=0.05)
        out["fp32"] = (cpu_params(ref), cpu_params(m), z._stage)
        ddp.close()
    finally:
        nd.destroy_process_group()
    return out


def train_gpu(model, opt, wrapped, train, clip=None):
    """zero_oracle.train with the batches moved to the model's GPU."""
    import torch

    class OnGpu(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x.cuda()).cpu()

    train(model, opt, OnGpu(wrapped), 0, 1, clip=clip)


def test_zero2_on_one_gpu_matches_unsharded_adamw():
    (res,) = run_ranks(_train_on_gpu, 1, timeout=240)
    reference, ours, stage = res["fp32"]
    assert stage == 2
    for key in reference:
        np.testing.assert_allclose(ours[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)
