"""nccl_ddp.fully_shard with a gradient scaler (torch's ShardedGradScaler and torch.amp.GradScaler,
on CPU), held to torch's own fully_shard with the same scaler over gloo: unscale_ on the sharded
(DTensor) grads, an inf in one rank's shard found by every rank, that step skipped everywhere and
the scale backed off."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import assert_same_run, full_params, gloo, shard_blocks, tokens, torch_and_ours, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402

STEPS, OVERFLOW = 6, 2  # step OVERFLOW gets an inf in rank 0's shard of one grad


def _train(model, rank: int, kind: str) -> dict:
    """Losses, scales and whether each step moved the parameters, with an inf on rank 0 only."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cls = ShardedGradScaler if kind == "sharded" else torch.amp.GradScaler
    scaler = cls("cpu", init_scale=2.0**8, growth_interval=2)
    losses, scales, moved = [], [], []
    for step, (x,) in enumerate(tokens(rank, STEPS)):
        opt.zero_grad()
        loss = model(x).float().mean()
        scaler.scale(loss).backward()
        if step == OVERFLOW and rank == 0:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        moved.append(any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())))
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "moved": moved, "params": full_params(model)}


def _scaler(rank: int, world: int, store_dir: str) -> dict:
    with gloo(rank, world, store_dir):
        return {
            (kind, who): _train(shard_blocks(transformer(2), fs), rank, kind)
            for kind in ("sharded", "amp")
            for who, fs in torch_and_ours()
        }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grad_scalers_skip_the_overflow_step_like_torch(tmp_path):
    for rank, got in enumerate(run_ranks(_scaler, 2, str(tmp_path), timeout=240)):
        for kind in ("sharded", "amp"):
            ours, ref = got[kind, "ours"], got[kind, "torch"]
            assert ours["moved"] == [True] * OVERFLOW + [False] + [True] * (STEPS - OVERFLOW - 1), (
                rank,
                kind,
            )
            assert ours["scales"][OVERFLOW] == ours["scales"][OVERFLOW - 1] / 2, (rank, kind)  # backed off
            assert_same_run(ours, ref, ("losses", "scales", "moved"), (rank, kind))
