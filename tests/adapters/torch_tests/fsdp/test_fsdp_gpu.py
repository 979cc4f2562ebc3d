"""fully_shard on one GPU over NCCL (world size 1: NCCL refuses two ranks on one device), run by
scripts/gpu_check.sh: the torch glue of the CUDA path (a cuda DeviceMesh, the shards as CuPy
memory under torch CUDA DTensors, the hooks with torch's current stream as the compute stream,
the NCCL all-gather and reduce-scatter on the comm stream, the bucket kernels' copy-out and pack,
record_stream of the packed grads) trains torch's test Transformer, sharded per block and at the
root, for a few AdamW steps to the losses of the same model unsharded on the same GPU; with a
bf16 param / fp32 reduce policy, to torch's own fully_shard's losses with that policy; with
`set_post_optim_event` each step, to the same losses. The
multi-rank arithmetic is proven without a GPU (tests/zero/test_unit_shards_cuda.py, fake NCCL).
Prepared on a machine without a GPU: not run there."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

pytestmark = pytest.mark.gpu

STEPS = 4


def _losses(model, steps, post_optim_event=False):
    import torch
    from fsdp_cases import tokens

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for (x,) in tokens(0, steps):
        opt.zero_grad()
        loss = model(x.cuda()).float().mean()
        loss.backward()
        opt.step()
        if post_optim_event:  # the next gathers after the step's event (recorded on a side stream)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            model.set_post_optim_event(side.record_event())
        out.append(loss.item())
    return out


def _train_on_gpu(rank: int, world: int, store_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from fsdp_cases import shard_blocks, transformer
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    import nccl_ddp as nd

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{os.path.join(store_dir, 'nccl')}", rank=rank, world_size=world
    )
    try:
        out = {"plain": _losses(transformer().cuda(), STEPS)}
        ours = shard_blocks(transformer().cuda(), nd.fully_shard)
        out["ours"] = _losses(ours, STEPS)
        p = next(ours.parameters())
        out["sharded"] = (isinstance(p, DTensor), p.device.type, p.to_local().device.type)
        out["backend"] = nd.get_world_group().backend
        out["post optim event"] = _losses(shard_blocks(transformer().cuda(), nd.fully_shard), STEPS, True)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out["bf16 torch"] = _losses(
            shard_blocks(transformer().cuda(), torch_fully_shard, mp_policy=mp), STEPS
        )
        out["bf16 ours"] = _losses(shard_blocks(transformer().cuda(), nd.fully_shard, mp_policy=mp), STEPS)
    finally:
        if nd.is_initialized():
            nd.destroy_process_group()
        dist.destroy_process_group()
    return out


def test_fully_shard_on_one_gpu_trains_as_the_unsharded_model(tmp_path):
    (res,) = run_ranks(_train_on_gpu, 1, str(tmp_path), timeout=240)
    assert res["backend"] == "nccl"
    assert res["sharded"] == (True, "cuda", "cuda")
    assert len(res["ours"]) == STEPS
    np.testing.assert_allclose(res["ours"], res["plain"], rtol=1e-6)
    np.testing.assert_allclose(res["post optim event"], res["ours"], rtol=1e-6)
    np.testing.assert_allclose(res["bf16 ours"], res["bf16 torch"], rtol=1e-3)
