"""PyTorch Lightning with `nccl_ddp.lightning.NcclDDPStrategy` against Lightning's own "ddp"
(torch DDP on gloo), two CPU processes: `fit` finishes; automatic optimization with gradient
accumulation (no_sync), manual optimization, BatchNorm buffers; a checkpoint saved after the fit
and resumed in a new Trainer continues as torch DDP's does. Parameters, buffers and the resumed
run equal torch DDP's exactly (2 ranks: the same arithmetic).

The processes come from tests/support/mp.py with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT); Lightning's own environment takes LOCAL_RANK and computes the rest, and the
strategy passes its ranks to nccl_ddp explicitly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("lightning", reason="Lightning is not installed")


def _module_class(manual: bool):
    import lightning.pytorch as pl
    import torch

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(int(os.environ["RANK"]))  # per rank: DDP broadcasts rank 0's
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
            )
            self.automatic_optimization = not manual

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                return None
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            data = torch.utils.data.TensorDataset(
                torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
            )
            return torch.utils.data.DataLoader(data, batch_size=4)

    return Net


def _fit(strategy, manual: bool, steps: int, ckpt_in=None, ckpt_out=None) -> dict:
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=1 if manual else 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = _module_class(manual)()
    trainer.fit(model, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    assert trainer.state.finished, trainer.state
    assert trainer.global_step == steps
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _run(rank: int, world: int, tmp: str) -> dict:
    import torch

    from nccl_ddp.lightning import NcclDDPStrategy

    torch.set_num_threads(1)
    out = {}
    for manual in (False, True):
        for name, make in (("torch", lambda: "ddp"), ("ours", NcclDDPStrategy)):
            ckpt = os.path.join(tmp, f"{name}-{manual}.ckpt")
            first = _fit(make(), manual, 4, ckpt_out=ckpt)
            resumed = _fit(make(), manual, 7, ckpt_in=ckpt)
            out[(name, manual)] = (first, resumed)
    import nccl_ddp as nd

    out["nd left initialised"] = nd.is_initialized()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_strategy_matches_torch_ddp(tmp_path):
    results = run_ranks(_run, 2, str(tmp_path), timeout=800)
    for rank, res in enumerate(results):
        assert res["nd left initialised"] is False  # the strategy tore its group down
        for manual in (False, True):
            ref, ours = res[("torch", manual)], res[("ours", manual)]
            for phase, r, o in (("fit", ref[0], ours[0]), ("resumed", ref[1], ours[1])):
                assert set(o) == set(r)
                for k in r:
                    diff = float(np.abs(o[k].astype(np.float64) - r[k]).max()) if r[k].size else 0.0
                    assert diff == 0.0, (rank, manual, phase, k, diff)
            # the resumed run trained on: it differs from the state it resumed from
            w = "net.0.weight"
            assert not np.array_equal(ours[0][w], ours[1][w])
            # num_batches_tracked counts the resumed steps (a buffer restored from the checkpoint)
            assert int(ours[1]["net.1.num_batches_tracked"]) > int(ours[0]["net.1.num_batches_tracked"])
    for manual in (False, True):  # DDP: both ranks end with the same parameters
        a, b = results[0][("ours", manual)][1], results[1][("ours", manual)][1]
        np.testing.assert_array_equal(a["net.0.weight"], b["net.0.weight"])


@pytest.mark.slow
def test_lightning_strategy_through_the_package_attribute():
    """README's spelling: `import nccl_ddp` then `nccl_ddp.lightning.NcclDDPStrategy()`; Lightning
    is loaded by that use, not by the import."""
    import subprocess
    import sys

    code = (
        "import sys, nccl_ddp\n"
        "assert 'lightning' not in sys.modules\n"
        "s = nccl_ddp.lightning.NcclDDPStrategy()\n"
        "assert 'lightning' in sys.modules\n"
        "print(type(s).__name__, nccl_ddp.accelerate.Accelerator.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NcclDDPStrategy", "Accelerator"]


def _refit(rank: int, world: int) -> dict:
    """One model through three fits, as users do: fit, fit the same Trainer again for more
    steps, then a new Trainer on the same model."""
    import lightning.pytorch as pl
    import torch

    from nccl_ddp.lightning import NcclDDPStrategy

    torch.set_num_threads(1)
    out = {}
    for name, make in (("torch", lambda: "ddp"), ("ours", NcclDDPStrategy)):

        def trainer(steps: int, strategy) -> pl.Trainer:
            return pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=strategy,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
            )

        model = _module_class(False)()
        first = trainer(3, make())
        first.fit(model)
        first.fit_loop.epoch_loop.max_steps = 6  # the same Trainer, fit again: 3 more steps
        first.fit(model)
        again = trainer(3, make())  # a new Trainer on the same model: 3 more
        again.fit(model)
        assert (first.global_step, again.global_step) == (6, 3)
        out[name] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fit_again_and_new_trainer_on_the_same_model():
    for rank, r in enumerate(run_ranks(_refit, 2, timeout=800)):
        for key, value in r["torch"].items():
            np.testing.assert_allclose(r["ours"][key], value, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {key}")
