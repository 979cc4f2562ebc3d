"""A `fully_shard([a, b])` unit whose modules do not simply run once each, in order, held to
torch's own fully_shard (torch 2.13's grouping rules) over gloo at 2 ranks:
- each module of the group casts its own inputs under a mixed-precision policy (torch's
  test_grouped_module_cast_forward_inputs: `b(a(x).float())`);
- the root's forward runs one module of the group and skips the other, which then runs on its
  own over chunks, each with a backward, before the root's output gets its backward (the chunked
  loss of torch's test_partial_group_forward_*): the skipped module's unit is completed at the
  root's post-forward and gathered again before each use (this crashed a rank with SIGSEGV:
  backward read the norm's weight after the unit had freed it);
- torch's `CPUOffloadPolicy` on CPU parameters (a no-op for ours: the shards are host memory).
Losses and trained parameters bit for bit torch's (each chunk's backward reduces on its own, as
torch's; when ours reduced once per step they differed in the last bits)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import chunked_head, full_params, gloo, torch_and_ours  # noqa: E402
from mp import run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Cast(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x).float())  # b's input is float32 again: its own pre-forward casts it


def _cast_steps(fs, rank: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = _Cast()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    fs([model.a, model.b], mp_policy=policy)
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model)}


def _chunked_steps(fs, rank: int, chunks: int) -> dict:
    torch.manual_seed(0)
    model = chunked_head()
    fs([model.norm, model.head])
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)
        h = model(torch.randn(2 * chunks, 8), skip_head=True)
        c = h.detach().requires_grad_(True)
        total = 0.0
        for chunk in torch.chunk(c, chunks):
            loss = model.head(chunk).pow(2).mean()
            loss.backward()
            total += loss.item()
        h.backward(c.grad)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": full_params(model)}


def _runs(rank: int, world: int, store_dir: str) -> dict:
    import functools

    from torch.distributed.fsdp import CPUOffloadPolicy

    out = {}
    with gloo(rank, world, store_dir):
        for who, fs in torch_and_ours():
            out["cast", who] = _cast_steps(fs, rank)
            for chunks in (1, 3):
                out[f"chunked{chunks}", who] = _chunked_steps(fs, rank, chunks)
            # CPU parameters stay in host memory: ours accepts torch's CPU offload as a no-op
            offload = functools.partial(fs, offload_policy=CPUOffloadPolicy(pin_memory=False))
            out["offload", who] = _chunked_steps(offload, rank, 2)
    return out


def test_grouped_units_run_partially_or_per_module_like_torch(tmp_path):
    import numpy as np

    ranks = run_ranks(_runs, 2, str(tmp_path), timeout=240)
    for (rank, got), name in itertools.product(enumerate(ranks), ("cast", "chunked1", "chunked3", "offload")):
        ours, ref = got[name, "ours"], got[name, "torch"]
        # each chunk's backward reduces apart, as torch's: the same sums, bit for bit
        assert ours["losses"] == ref["losses"], (rank, name)
        for pname, value in ref["params"].items():
            np.testing.assert_array_equal(ours["params"][pname], value, err_msg=f"{rank} {name} {pname}")
