"""Hugging Face Accelerate with `nccl_ddp.accelerate.Accelerator` against accelerate's own (torch
DDP on gloo), two CPU processes: `prepare`, `accumulate` (no_sync every other batch),
`DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)`, `save_state` mid-run and
`load_state` into a fresh model and optimizer that then continues. Parameters and buffers equal
torch DDP's exactly (2 ranks: the same arithmetic, fp16 included), and the resumed run equals the
uninterrupted one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("accelerate", reason="Accelerate is not installed")

FIRST, THEN = 4, 4  # batches before save_state, batches after


def _parts(accelerator):
    import torch

    torch.manual_seed(11 + accelerator.process_index)  # per rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 2, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    return accelerator.prepare(model, opt, loader)


def _steps(accelerator, model, opt, batches) -> None:
    import torch

    for x, y in batches:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()


def _state(accelerator, model) -> dict:
    return {k: v.detach().numpy().copy() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def _run_one(cls, fp16: bool, ckpt: str) -> tuple:
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    kwargs = [DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)] if fp16 else []
    acc = cls(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=kwargs)
    model, opt, loader = _parts(acc)
    batches = list(loader)
    _steps(acc, model, opt, batches[:FIRST])
    acc.save_state(ckpt)
    _steps(acc, model, opt, batches[FIRST : FIRST + THEN])
    straight = _state(acc, model)
    # a resumed script: a new Accelerator, fresh objects, then the saved state
    acc2 = cls(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=kwargs)
    model2, opt2, _ = _parts(acc2)
    acc2.load_state(ckpt)
    _steps(acc2, model2, opt2, batches[FIRST : FIRST + THEN])
    resumed = _state(acc2, model2)
    return straight, resumed, type(model).__module__, acc


def _run(rank: int, world: int, tmp: str) -> dict:
    import accelerate
    import torch

    import nccl_ddp as nd
    from nccl_ddp.accelerate import Accelerator

    torch.set_num_threads(1)
    out, first_ours = {}, None
    for fp16 in (False, True):
        for name, cls in (("torch", accelerate.Accelerator), ("ours", Accelerator)):
            *res, acc = _run_one(cls, fp16, os.path.join(tmp, f"{name}-{fp16}"))
            out[(name, fp16)] = tuple(res)
            if name == "ours" and first_ours is None:
                first_ours = acc  # joined our group: its end_training destroys it
    first_ours.end_training()  # (and torch's group: accelerate's end of training)
    out["nd left initialised"] = nd.is_initialized()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_prepare_builds_ours_and_matches_torch_ddp(tmp_path):
    results = run_ranks(_run, 2, str(tmp_path), timeout=800)
    for rank, res in enumerate(results):
        assert res["nd left initialised"] is False
        for fp16 in (False, True):
            ref_straight, ref_resumed, ref_kind = res[("torch", fp16)]
            straight, resumed, kind = res[("ours", fp16)]
            assert ref_kind.startswith("torch.") and kind.startswith("nccl_ddp."), (ref_kind, kind)
            for what, r, o in (
                ("straight", ref_straight, straight),
                ("resumed", ref_resumed, resumed),
                ("resumed = straight", straight, resumed),
            ):
                assert set(o) == set(r)
                for k in r:
                    np.testing.assert_array_equal(o[k], r[k], err_msg=f"rank {rank} fp16={fp16} {what} {k}")
    # fp16 on the wire changed the result; both ranks hold the same parameters
    r0 = results[0]
    w = "0.weight"
    assert not np.array_equal(r0[("ours", True)][0][w], r0[("ours", False)][0][w])
    np.testing.assert_array_equal(r0[("ours", True)][0][w], results[1][("ours", True)][0][w])
