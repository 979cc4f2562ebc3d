"""Hugging Face `Trainer(max_grad_norm=...)` with nd.ZeroRedundancyOptimizer (the default stage,
ZeRO-1) given as the Trainer's optimizer, `nccl_ddp.transformers.Trainer` against transformers'
own with the unsharded SGD (torch DDP on gloo through Accelerate), two CPU processes, a tiny GPT-2
from a config: the clipping (accelerator.clip_grad_norm_, routed to the optimizer's global norm)
and transformers' LR schedule on our param groups give the same parameters to 1e-6; and clipping
acted (a run with max_grad_norm=0 differs). transformers' prepare moves the model (`.to("cpu:0")`:
new storage) after the optimizer is built; the optimizer re-points the parameters at its step.
A checkpoint every 2 steps (the sharded state consolidated on rank 0 for transformers to save)
and a new Trainer resuming from step 2 equal transformers' own resumed run too.
(SGD, not AdamW: GPT-2's attention key biases get pure rounding-noise grads, which AdamW's
normalisation blows up to the 1e-6 level on any last-ulp difference of a vectorised sqrt.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tiny_gpt2
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")


def _train(cls, rank: int, out: str, sharded: bool, max_grad_norm: float, resume=None) -> dict:
    """Saves a checkpoint every tiny_gpt2.SAVE_EVERY steps; `resume`: from that checkpoint directory."""
    import torch

    import nccl_ddp as nd

    args = tiny_gpt2.training_args(out, max_grad_norm)
    model = tiny_gpt2.model(rank)
    opt = (
        nd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        if sharded
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    trainer = cls(model=model, args=args, train_dataset=tiny_gpt2.data(32, 1), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    return tiny_gpt2.params(trainer.model)


def _run(rank: int, world: int, tmp: str) -> dict:
    import torch
    import transformers

    import nccl_ddp.transformers as ndt

    torch.set_num_threads(1)
    out = {"unclipped": _train(transformers.Trainer, rank, os.path.join(tmp, "unclipped"), False, 0.0)}
    for name, cls, sharded in (("torch", transformers.Trainer, False), ("ours", ndt.Trainer, True)):
        out[name] = _train(cls, rank, os.path.join(tmp, name), sharded, 0.5)
        ckpt = os.path.join(tmp, name, f"checkpoint-{tiny_gpt2.SAVE_EVERY}")
        out[name + "-resumed"] = _train(cls, rank, os.path.join(tmp, name + "-r"), sharded, 0.5, resume=ckpt)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_max_grad_norm_on_sharded_optimizer_matches_transformers(tmp_path):
    results = run_ranks(_run, 2, str(tmp_path), timeout=800)
    for rank, res in enumerate(results):
        ref = res["torch"]
        assert any(not np.allclose(res["unclipped"][k], ref[k]) for k in ref)  # clipping acted
        for run in ("", "-resumed"):
            for k, v in res["torch" + run].items():
                msg = f"rank {rank} ours{run}: {k}"
                np.testing.assert_allclose(res["ours" + run][k], v, rtol=1e-6, atol=1e-6, err_msg=msg)
