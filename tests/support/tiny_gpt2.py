"""A tiny GPT-2 built from a config (no download), its token data and the TrainingArguments the
Hugging Face Trainer tests share: every rank builds the same pieces, so our Trainer and
transformers' own DDP run see the same model, data and settings."""

from __future__ import annotations

from typing import Any

STEPS, SAVE_EVERY, VOCAB, SEQ = 4, 2, 64, 16


def model(rank: int) -> Any:
    """Seeded per rank: DDP starts every rank from rank 0's, so the ranks must differ here."""
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
    torch.manual_seed(7 + rank)
    return GPT2LMHeadModel(config)


def data(n: int, seed: int) -> list:
    """`n` random sequences of SEQ tokens, each its own label (causal LM)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out: str, max_grad_norm: float, **extra: Any) -> Any:
    """STEPS steps of batch 2 on the CPU, a checkpoint every SAVE_EVERY steps, seed 3, no reports."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        learning_rate=1e-2,
        max_grad_norm=max_grad_norm,
        use_cpu=True,
        report_to=[],
        seed=3,
        logging_steps=100,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def params(model: Any) -> dict:
    """The model's state as NumPy copies, by name."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
