"""The torch wrapper pickles as torch's DDP does (2 CPU processes, torch's DDP on gloo doing the
same): `torch.save(model)` mid-training, `torch.load`, training goes on; `copy.deepcopy` of a
wrapper trains too. What is rebuilt after loading (reducer, group, grad hooks, the comm hook) is
ours again, and the parameters equal torch's after every step. A wrapper on a subgroup refuses, as
torch's does off its default group.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
from torch_gloo import beside_torch, on_two_ranks, raised
from torch_oracle import IN, OracleConfig, batches

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

CONFIG = OracleConfig(steps=6)


class Net(torch.nn.Module):
    """A module pickle finds by name (torch.save of a model stores its class by reference): a
    branch unused on odd steps and a buffer that differs per rank until DDP broadcasts it."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(7 + rank)
        self.body = torch.nn.Linear(IN, IN)
        self.branch = torch.nn.Linear(IN, IN)
        self.register_buffer("scale", torch.full((IN,), 1.0 + rank))

    def forward(self, x, use_branch: bool = True):
        h = torch.tanh(self.body(x)) * self.scale
        return h + self.branch(h) if use_branch else h


def make_model(rank: int) -> Net:
    return Net(rank)


def _steps(ddp, data, rank: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for micro, (x, y) in data:
        torch.nn.functional.mse_loss(ddp(x, use_branch=CONFIG.uses_branch(micro, rank)), y).backward()
        opt.step()
        opt.zero_grad()


def _state(ddp) -> dict:
    return {k: v.detach().numpy().copy() for k, v in ddp.state_dict().items()}


def _save_load_train(rank: int, ddp_class: type) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    data = list(enumerate(batches(rank, CONFIG)))
    ddp = ddp_class(make_model(rank), find_unused_parameters=True)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    _steps(ddp, data[:2], rank)
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out = {"saved equals loaded": all(np.array_equal(v, _state(loaded)[k]) for k, v in _state(ddp).items())}
    _steps(loaded, data[2:4], rank)
    out["after load"] = _state(loaded)
    out["hook"] = loaded._get_ddp_logging_data().get("comm_hook", "")
    twin = copy.deepcopy(loaded)
    _steps(twin, data[4:], rank)
    out["deepcopy"] = _state(twin)
    return out


def _pickling(rank: int, world: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    with beside_torch(rank, world, store):
        out = {
            "torch": _save_load_train(rank, TorchDDP),
            "ours": _save_load_train(rank, nd.DistributedDataParallel),
        }
        alone = nd.DistributedDataParallel(make_model(rank), process_group=dist.new_group([rank]))
        out["subgroup"] = raised(lambda: torch.save(alone, io.BytesIO()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_load_and_deepcopy_train_as_torchs(tmp_path):
    for r in on_two_ranks(_pickling, tmp_path):
        ours, theirs = r["ours"], r["torch"]
        assert ours["saved equals loaded"] and theirs["saved equals loaded"]
        for phase in ("after load", "deepcopy"):
            assert set(ours[phase]) == set(theirs[phase])
            for key, value in theirs[phase].items():
                np.testing.assert_allclose(
                    ours[phase][key], value, rtol=1e-6, atol=1e-6, err_msg=f"{phase} {key}"
                )
        assert ours["hook"], "the comm hook was not registered again after loading"
        assert r["subgroup"] is not None and "world group only" in r["subgroup"][1]
