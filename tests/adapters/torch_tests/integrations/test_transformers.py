"""Hugging Face `transformers.Trainer` with `nccl_ddp.transformers.Trainer` against transformers' own
(torch DDP on gloo through Accelerate), two CPU processes, a tiny GPT-2 built from a config (no
download): train with `max_grad_norm` and a checkpoint every 2 steps, `evaluate`, `save_model`, and
a new Trainer resuming from the step-2 checkpoint, and a second Trainer training the same model
further. Parameters (trained, saved, resumed, trained again) and the
evaluation loss equal transformers' own DDP run to 1e-6 (2 ranks: the same arithmetic).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tiny_gpt2
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")


def _trainer(cls, rank: int, out: str, model=None):
    args = tiny_gpt2.training_args(out, 0.5, per_device_eval_batch_size=2)
    model = tiny_gpt2.model(rank) if model is None else model
    return cls(model=model, args=args, train_dataset=tiny_gpt2.data(32, 1), eval_dataset=tiny_gpt2.data(8, 2))


def _run(rank: int, world: int, tmp: str) -> dict:
    import torch
    import transformers
    from safetensors.numpy import load_file

    import nccl_ddp.transformers as ndt

    torch.set_num_threads(1)
    out = {}
    for name, cls in (("torch", transformers.Trainer), ("ours", ndt.Trainer)):
        trainer = _trainer(cls, rank, os.path.join(tmp, name))
        trainer.train()
        wrapped = type(trainer.model_wrapped).__module__
        loss = trainer.evaluate()["eval_loss"]
        trainer.save_model(os.path.join(tmp, name, "final"))
        trainer.accelerator.wait_for_everyone()
        saved = load_file(os.path.join(tmp, name, "final", "model.safetensors"))
        resumed = _trainer(cls, rank, os.path.join(tmp, name + "-resumed"))
        resumed.train(resume_from_checkpoint=os.path.join(tmp, name, f"checkpoint-{tiny_gpt2.SAVE_EVERY}"))
        again = _trainer(cls, rank, os.path.join(tmp, name + "-again"), model=trainer.model)
        params = tiny_gpt2.params(trainer.model)
        again.train()  # a second Trainer on the same (trained) model
        out[name] = {
            "params": params,
            "again": tiny_gpt2.params(again.model),
            "eval_loss": loss,
            "saved": saved,
            "resumed": tiny_gpt2.params(resumed.model),
            "wrapper": wrapped,
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_transformers_trainer_matches_its_own_ddp(tmp_path):
    results = run_ranks(_run, 2, str(tmp_path), timeout=800)
    for rank, r in enumerate(results):
        theirs, ours = r["torch"], r["ours"]
        assert theirs["wrapper"].startswith("torch.nn.parallel"), theirs["wrapper"]
        assert ours["wrapper"] == "nccl_ddp.adapters.torch.ddp", ours["wrapper"]
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
        for key, value in theirs["params"].items():
            np.testing.assert_allclose(
                ours["params"][key], value, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {key}"
            )
            np.testing.assert_allclose(
                ours["resumed"][key], value, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {key}"
            )
        assert set(ours["saved"]) == set(theirs["saved"])
        for key, value in theirs["saved"].items():
            np.testing.assert_allclose(
                ours["saved"][key], value, rtol=1e-6, atol=1e-6, err_msg=f"saved {key}"
            )
