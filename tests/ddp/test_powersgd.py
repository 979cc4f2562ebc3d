"""PowerSGD (`nccl_ddp.hooks.powersgd`) against torch's `powerSGD_hook` on the same grads.

Two ranks train the same two-layer model with torch DDP + torch's PowerSGDState / powerSGD_hook
(gloo) and with ours + our PowerSGDState on the host backend, from the same initial low-rank
factors (torch.randn inside torch's hook and our `random_factors` both return one fixed matrix per
shape). Every step's reduced grads must agree to 1e-5, through the switch from all-reduce to
PowerSGD, error feedback and warm start. A training run compares convergence with plain
all-reduce.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

STEPS = 7
START = 3


def _factor(shape) -> np.ndarray:
    """The fixed initial factor of one (m, r) shape."""
    m, r = shape[-2:]
    return np.random.RandomState(1000 * m + r).standard_normal((m, r)).astype(np.float32)


def _model(rank: int):
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _data(rank: int, steps: int):
    g = np.random.default_rng(50 + rank)
    return [
        (
            torch.from_numpy(g.standard_normal((6, 16), dtype=np.float32)),
            torch.from_numpy(g.standard_normal((6, 8), dtype=np.float32)),
        )
        for _ in range(steps)
    ]


def _train(ddp, module, rank: int, steps: int, lr: float = 0.05) -> tuple:
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    grads, losses = [], []
    for x, y in _data(rank, steps):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append({n: p.grad.detach().numpy().copy() for n, p in module.named_parameters()})
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return grads, losses


def _torch_and_ours(rank: int, world: int, store_dir: str, rank_r: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel
    from torch_oracle import gloo_group

    import nccl_ddp as nd
    from nccl_ddp import hooks

    torch.set_num_threads(1)
    real_randn = torch.randn

    def fixed_randn(*shape, device=None, dtype=None):
        return torch.from_numpy(_factor(shape)).reshape(shape).to(dtype)

    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        module = _model(rank)
        ddp = DistributedDataParallel(module)
        state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START)
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        torch_psgd.torch.randn = fixed_randn  # the module's `torch` is the torch package
        try:
            ref, _ = _train(ddp, module, rank, STEPS)
        finally:
            torch_psgd.torch.randn = real_randn
        torch_errors = {k: v.numpy().copy() for k, v in state.error_dict.items()}

    class FixedState(hooks.PowerSGDState):
        def random_factors(self, seed, shapes, dtype):
            return [_factor(s) for s in shapes]

    nd.init_process_group("host")
    try:
        module = _model(rank)
        ddp = nd.DistributedDataParallel(module)
        state = FixedState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START)
        ddp.register_comm_hook(state, hooks.powersgd)
        ours, _ = _train(ddp, module, rank, STEPS)
        our_errors = {k: np.array(v) for k, v in state.error_dict.items()}
        stats = state.compression_stats()
        ddp.close()
    finally:
        nd.destroy_process_group()
    return {"ref": ref, "ours": ours, "torch_errors": torch_errors, "our_errors": our_errors, "stats": stats}


@pytest.mark.parametrize("rank_r", [1, 2, 4])
@pytest.mark.slow
def test_powersgd_matches_torch(rank_r, tmp_path):
    results = run_ranks(_torch_and_ours, 2, str(tmp_path), rank_r, timeout=180)
    for rank, res in enumerate(results):
        for step, (ours, ref) in enumerate(zip(res["ours"], res["ref"])):
            for name in ref:
                np.testing.assert_allclose(
                    ours[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=f"rank {rank} step {step} {name}"
                )
        # error feedback: the residual each rank keeps (torch's bucket has no padding)
        ((tb, te),) = res["torch_errors"].items()
        ((ob, oe),) = res["our_errors"].items()
        assert float(np.abs(te).max()) > 1e-4  # something was lost, and fed back
        assert sorted(np.round(np.abs(te), 5))[-5:] == sorted(np.round(np.abs(oe), 5))[-5:]
        rate, before, after = res["stats"]
        assert rate > 1.5 and after < before
    # before START the hook is a plain all-reduce: identical grads on both ranks
    for name in results[0]["ours"][0]:
        np.testing.assert_array_equal(results[0]["ours"][0][name], results[1]["ours"][0][name])


def _converges(rank: int, world: int, hook: str) -> list:
    import nccl_ddp as nd
    from nccl_ddp import hooks

    torch.set_num_threads(1)
    nd.init_process_group("host")
    try:
        module = _model(rank)
        ddp = nd.DistributedDataParallel(module)
        if hook == "powersgd":
            ddp.register_comm_hook(
                hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10), hooks.powersgd
            )
        # one fixed batch per rank: the loss must go down steadily
        x, y = _data(rank, 1)[0]
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        losses = []
        for _ in range(150):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        ddp.close()
        return losses
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_powersgd_training_converges_like_allreduce():
    plain = run_ranks(_converges, 2, "allreduce", timeout=120)
    psgd = run_ranks(_converges, 2, "powersgd", timeout=120)
    for rank in range(2):
        assert psgd[rank][-1] < 0.5 * psgd[rank][0], psgd[rank][::30]
        # within 25% of plain all-reduce's final loss
        assert psgd[rank][-1] <= 1.25 * plain[rank][-1], (psgd[rank][-1], plain[rank][-1])
