"""Checkpoints of nd.ZeroRedundancyOptimizer across world sizes: 5 steps at 2 ranks, the state
consolidated on rank 0 and saved in torch's format, resumed at 3 ranks and at 1 rank for 5 more
steps: the parameters equal 10 uninterrupted steps of the unsharded torch optimizer (to 1e-6),
and the saved state loads into a plain torch.optim.AdamW."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from zero_oracle import OPTIMIZERS, make_model, params_of, train  # noqa: E402

HALF = 5
STAGES = [1, 2]


def _wrapped(m, stage: int, rank: int, world: int, store: str):
    import torch.distributed as dist

    import nccl_ddp as nd

    torch.set_num_threads(1)
    nd.init_process_group("host")
    if stage == 2:
        return nd.DistributedDataParallel(m, bucket_cap_mb=400 / (1 << 20), zero=nd.ZeroConfig(stage=2))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return torch.nn.parallel.DistributedDataParallel(m)


def _close(stage: int) -> None:
    import torch.distributed as dist

    import nccl_ddp as nd

    nd.destroy_process_group()
    if stage == 1:
        dist.destroy_process_group()


def _save(rank: int, world: int, stage: int, path: str, store: str) -> dict:
    import nccl_ddp as nd

    m = make_model()
    wrapped = _wrapped(m, stage, rank, world, store)
    cls, kw = OPTIMIZERS["adamw"]
    z = nd.ZeroRedundancyOptimizer(m.parameters(), getattr(torch.optim, cls), zero_stage=stage, **kw)
    train(m, z, wrapped, rank, world, steps=HALF)
    z.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": m.state_dict(), "optimizer": z.state_dict()}, path)
    _close(stage)
    return params_of(m)


def _resume(rank: int, world: int, stage: int, path: str, store: str) -> dict:
    import nccl_ddp as nd

    m = make_model()
    saved = torch.load(path)
    m.load_state_dict(saved["model"])
    wrapped = _wrapped(m, stage, rank, world, store)
    cls, kw = OPTIMIZERS["adamw"]
    z = nd.ZeroRedundancyOptimizer(m.parameters(), getattr(torch.optim, cls), zero_stage=stage, **kw)
    z.load_state_dict(saved["optimizer"])
    out = train(m, z, wrapped, rank, world, steps=HALF, start=HALF)
    _close(stage)
    return out


def _unsharded(steps: int, start: int = 0, model=None, opt=None):
    cls, kw = OPTIMIZERS["adamw"]
    m = make_model() if model is None else model
    opt = getattr(torch.optim, cls)(m.parameters(), **kw) if opt is None else opt
    train(m, opt, m, 0, 1, steps=steps, start=start)
    return m, opt


@pytest.mark.slow
@pytest.mark.timeout(600)  # three jobs of 2, 3 and 1 ranks
@pytest.mark.parametrize("stage", STAGES)
def test_save_at_2_resume_at_3_and_1(stage, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = run_ranks(_save, 2, stage, path, str(tmp_path / "g2"), timeout=180)
    m, opt = _unsharded(HALF)
    for rank, params in enumerate(saved):
        for k, v in params_of(m).items():
            np.testing.assert_allclose(
                params[k], v, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} after {HALF} steps: {k}"
            )
    # the consolidated state is torch's: a plain AdamW loads it and continues like ours
    ck = torch.load(path)
    ref_state = opt.state_dict()
    assert set(ck["optimizer"]["state"]) == set(ref_state["state"])
    for i, s in ref_state["state"].items():
        for key, v in s.items():
            np.testing.assert_allclose(
                ck["optimizer"]["state"][i][key].numpy(),
                v.numpy(),
                rtol=1e-6,
                atol=1e-7,
                err_msg=f"state {i} {key}",
            )
    _unsharded(HALF, HALF, m, opt)
    expected = params_of(m)
    fresh = make_model()
    fresh.load_state_dict(ck["model"])
    cls, kw = OPTIMIZERS["adamw"]
    plain = getattr(torch.optim, cls)(fresh.parameters(), **kw)
    plain.load_state_dict(ck["optimizer"])
    _unsharded(HALF, HALF, fresh, plain)
    for world in (3, 1):
        store = str(tmp_path / f"g{world}")
        for rank, params in enumerate(run_ranks(_resume, world, stage, path, store, timeout=180)):
            for k, v in expected.items():
                np.testing.assert_allclose(
                    params[k], v, rtol=1e-6, atol=1e-6, err_msg=f"resumed at world {world}, rank {rank}: {k}"
                )
    for k, v in expected.items():
        np.testing.assert_allclose(params_of(fresh)[k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    assert os.path.exists(path)
