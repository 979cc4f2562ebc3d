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
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

STEPS, SAVE_EVERY, VOCAB, SEQ = 4, 2, 64, 16


def _model(rank: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(7 + rank)  # per rank: DDP starts every rank from rank 0's
    return GPT2LMHeadModel(config)


def _data(n: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def _trainer(cls, rank: int, out: str, model=None):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        use_cpu=True,
        report_to=[],
        seed=3,
        logging_steps=100,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = _model(rank) if model is None else model
    return cls(model=model, args=args, train_dataset=_data(32, 1), eval_dataset=_data(8, 2))


def _params(model) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


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
        resumed.train(resume_from_checkpoint=os.path.join(tmp, name, f"checkpoint-{SAVE_EVERY}"))
        again = _trainer(cls, rank, os.path.join(tmp, name + "-again"), model=trainer.model)
        params = _params(trainer.model)
        again.train()  # a second Trainer on the same (trained) model
        out[name] = {
            "params": params,
            "again": _params(again.model),
            "eval_loss": loss,
            "saved": saved,
            "resumed": _params(resumed.model),
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
        assert ours["wrapper"] == "nccl_ddp.adapters.torch_ddp", ours["wrapper"]
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
