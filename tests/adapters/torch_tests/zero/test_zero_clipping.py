"""Gradient clipping through Lightning and Accelerate on nd.ZeroRedundancyOptimizer (2 CPU
processes): `Trainer(gradient_clip_val=0.05)` with `NcclDDPStrategy` and `accelerator.clip_grad_norm_`
with our `Accelerator`, the optimizer sharded with the default (ZeRO-1) and with ZeRO-2 (the
strategy's / Accelerator's zero=ZeroConfig(stage=2)),
equal Lightning's "ddp" / accelerate's own Accelerator (torch DDP on gloo) with the unsharded SGD
to 1e-6; and clipping did act (the unclipped run differs). A Lightning checkpoint of the sharded
optimizer saved mid-run and resumed by a new Trainer continues as Lightning's "ddp" does.
Before: ZeRO-2 clipped local grads
(parameters 0.39 away), and accelerate's prepare failed on the optimizer's state_dict()."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")

STAGES = ("default", "zero2")  # zero2: the model built with zero=ZeroConfig(stage=2)
CLIP = 0.05
SAVE_AT = 3


def _optimizer(params, kind: str):
    import torch

    import nccl_ddp as nd

    if kind == "torch":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return nd.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.05, momentum=0.9)  # the model's stage


def _data():
    import torch

    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g) * 5
    )


def _net(seed: int):
    import torch

    torch.manual_seed(seed)  # per rank: DDP broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _lightning_fit(strategy, kind: str, clip, steps: int = 5, ckpt_in=None, ckpt_out=None) -> dict:
    """`ckpt_out`: saved from inside the fit after step SAVE_AT (a sharded optimizer's
    consolidation is a collective of our group, which the strategy tears down with the fit)."""
    import lightning.pytorch as pl
    import torch

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(int(os.environ["RANK"]))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return _optimizer(self.parameters(), kind)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_data(), batch_size=4)

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if ckpt_out is not None and trainer.global_step == SAVE_AT:
                trainer.save_checkpoint(ckpt_out)  # Lightning consolidates a sharded optimizer

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[SaveAt()],
    )
    model = Net()
    trainer.fit(model, ckpt_path=ckpt_in)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _lightning(rank: int, world: int) -> dict:
    import torch

    import nccl_ddp as nd
    from nccl_ddp.lightning import NcclDDPStrategy

    torch.set_num_threads(1)
    out = {"torch": _lightning_fit("ddp", "torch", CLIP), "unclipped": _lightning_fit("ddp", "torch", None)}
    for kind in STAGES:
        zero = nd.ZeroConfig(stage=2) if kind == "zero2" else None
        out[kind] = _lightning_fit(NcclDDPStrategy(zero=zero), kind, CLIP)
    return out


def _lightning_resume(rank: int, world: int, tmp: str) -> dict:
    import torch

    import nccl_ddp as nd
    from nccl_ddp.lightning import NcclDDPStrategy

    torch.set_num_threads(1)
    out = {}
    for kind in ("torch", *STAGES):
        zero = nd.ZeroConfig(stage=2) if kind == "zero2" else None

        def strategy():
            return "ddp" if kind == "torch" else NcclDDPStrategy(zero=zero)

        ckpt = os.path.join(tmp, f"{kind}.ckpt")
        straight = _lightning_fit(strategy(), kind, None, steps=6, ckpt_out=ckpt)
        out[kind] = (straight, _lightning_fit(strategy(), kind, None, steps=6, ckpt_in=ckpt))
    return out


def _accelerate_run(cls, kind: str, clip, **extra) -> tuple:
    import torch

    acc = cls(cpu=True, gradient_accumulation_steps=2, **extra)
    model = acc.prepare(_net(11 + acc.process_index))
    opt = acc.prepare(_optimizer(model.parameters(), kind))  # after wrapping: ZeRO-2 needs our DDP
    loader = acc.prepare(torch.utils.data.DataLoader(_data(), batch_size=4))
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip is not None and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    state = {k: v.detach().numpy().copy() for k, v in acc.unwrap_model(model).state_dict().items()}
    return state, acc


def _accelerate(rank: int, world: int) -> dict:
    import accelerate
    import torch

    import nccl_ddp as nd
    from nccl_ddp.accelerate import Accelerator

    torch.set_num_threads(1)
    out = {
        "torch": _accelerate_run(accelerate.Accelerator, "torch", CLIP)[0],
        "unclipped": _accelerate_run(accelerate.Accelerator, "torch", None)[0],
    }
    first = None
    for kind in STAGES:
        zero = nd.ZeroConfig(stage=2) if kind == "zero2" else None
        out[kind], acc = _accelerate_run(Accelerator, kind, CLIP, zero=zero)
        first = first or acc  # joined our group: its end_training destroys it
    first.end_training()
    out["nd left initialised"] = nd.is_initialized()
    return out


def _accelerate_resume(rank: int, world: int, tmp: str) -> dict:
    """save_state after 4 batches, 4 more; then a fresh Accelerator, model and optimizer that
    load_state and run the same 4: (straight, resumed) per kind."""
    import accelerate
    import torch

    import nccl_ddp as nd
    from nccl_ddp.accelerate import Accelerator

    torch.set_num_threads(1)
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=4))
    mine = batches[rank::world]

    def run(acc, model, opt, part) -> None:
        for x, y in part:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    out, first = {}, None
    for kind in ("torch", *STAGES):
        cls = accelerate.Accelerator if kind == "torch" else Accelerator
        extra = {} if kind == "torch" else {"zero": nd.ZeroConfig(stage=2) if kind == "zero2" else None}
        states = []
        for resumed in (False, True):
            acc = cls(cpu=True, **extra)
            if kind != "torch":
                first = first or acc  # joined our group: its end_training destroys it
            model = acc.prepare(_net(11 + acc.process_index))
            opt = acc.prepare(_optimizer(model.parameters(), kind))
            ckpt = os.path.join(tmp, kind)
            if resumed:
                acc.load_state(ckpt)
            else:
                run(acc, model, opt, mine[:4])
                acc.save_state(ckpt)
            run(acc, model, opt, mine[4:8])
            states.append(
                {k: v.detach().numpy().copy() for k, v in acc.unwrap_model(model).state_dict().items()}
            )
        out[kind] = tuple(states)
    first.end_training()
    return out


def _check(results) -> None:
    for rank, res in enumerate(results):
        ref = res["torch"]
        assert any(not np.allclose(res["unclipped"][k], ref[k]) for k in ref)  # clipping acted
        for kind in STAGES:
            for k in ref:
                np.testing.assert_allclose(
                    res[kind][k], ref[k], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {kind}: {k}"
                )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_gradient_clip_val_on_sharded_optimizer_matches_ddp():
    pytest.importorskip("lightning", reason="Lightning is not installed")
    _check(run_ranks(_lightning, 2, timeout=800))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_checkpoint_of_sharded_optimizer_resumes_as_ddp(tmp_path):
    """trainer.save_checkpoint inside the fit after step 3 and a new Trainer resuming it to 6: the
    sharded optimizer's state (SGD momentum) goes through Lightning's consolidate-then-save and is
    loaded back on every rank, so the resumed run equals Lightning's "ddp" + unsharded SGD's
    (which restarts the epoch's batches, as Lightning does)."""
    pytest.importorskip("lightning", reason="Lightning is not installed")
    results = run_ranks(_lightning_resume, 2, str(tmp_path), timeout=800)
    for rank, res in enumerate(results):
        for kind in STAGES:
            for phase in (0, 1):  # the run that saved, the resumed one
                for k, v in res["torch"][phase].items():
                    msg = f"rank {rank} {kind} {('saving', 'resumed')[phase]}: {k}"
                    np.testing.assert_allclose(res[kind][phase][k], v, rtol=1e-6, atol=1e-6, err_msg=msg)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_save_state_of_sharded_optimizer_resumes_exactly(tmp_path):
    """accelerator.save_state consolidates the sharded optimizer on the main process (before:
    ConfigError 'not consolidated' on every rank), load_state gives every rank its shards back:
    the resumed run equals the uninterrupted one and accelerate's own with unsharded SGD."""
    pytest.importorskip("accelerate", reason="Accelerate is not installed")
    results = run_ranks(_accelerate_resume, 2, str(tmp_path), timeout=800)
    for rank, res in enumerate(results):
        ref_straight, ref_resumed = res["torch"]
        for kind in STAGES:
            straight, resumed = res[kind]
            for k in ref_straight:
                msg = f"rank {rank} {kind}: {k}"
                np.testing.assert_allclose(straight[k], ref_straight[k], rtol=1e-6, atol=1e-6, err_msg=msg)
                np.testing.assert_allclose(resumed[k], ref_resumed[k], rtol=1e-6, atol=1e-6, err_msg=msg)
                np.testing.assert_allclose(resumed[k], straight[k], rtol=1e-6, atol=1e-6, err_msg=msg)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_clip_grad_norm_on_sharded_optimizer_matches_ddp():
    pytest.importorskip("accelerate", reason="Accelerate is not installed")
    results = run_ranks(_accelerate, 2, timeout=800)
    assert all(res["nd left initialised"] is False for res in results)
    _check(results)
