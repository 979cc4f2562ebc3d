"""Our DistributedDataParallel in torch's thread world (every rank a thread, backend "threaded"):
given torch's group, its buckets are all-reduced by a host group of ours whose collectives torch
carries (adapters/torch/carried.py); with process_group=None it says what to pass instead (our
own world is per process and runs no "threaded" backend)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

import torch.distributed as dist  # noqa: E402
from thread_world import thread_world  # noqa: E402


def _ddp_step(rank: int, group: bool) -> dict:
    import nccl_ddp as nd

    model = torch.nn.Linear(4, 2)
    with torch.no_grad():  # different on every rank: the init sync broadcasts rank 0's
        model.weight.fill_(rank + 1.0)
        model.bias.zero_()
    ddp = nd.DistributedDataParallel(model, process_group=dist.group.WORLD if group else None)
    w0 = model.weight.detach().clone()
    ddp(torch.full((3, 4), rank + 1.0)).sum().backward()
    return {"w0": w0, "grad": model.weight.grad.clone(), "bias_grad": model.bias.grad.clone()}


@pytest.mark.slow
def test_ddp_given_torch_group_averages_in_the_thread_world():
    for res in thread_world(lambda r: _ddp_step(r, True), 2):
        assert res["w0"].eq(1.0).all()  # rank 0's weights on both
        # d(sum)/dW = 3 rows of (rank + 1): 3 and 6, averaged over the ranks
        assert res["grad"].eq(4.5).all() and res["bias_grad"].eq(3.0).all()


@pytest.mark.slow
def test_ddp_without_a_group_names_what_to_pass():
    with pytest.raises(AssertionError, match="runs backend 'threaded'.*group.WORLD"):
        thread_world(lambda r: _ddp_step(r, False), 2)
