"""The CPU behaviours of pytorch's test/distributed/test_c10d_gloo.py DistributedDataParallelTest
(not in the torch wheel, so not run by test_torch_suite.py), each held to torch's own DDP on gloo
on 2 CPU processes. torch.distributed starts as those tests start it: `init_process_group("gloo",
store=FileStore(...))`, and the model gets torch's default group as `process_group=`.

- test_gloo_backend_cpu_module (and _grad_is_view): a 3-layer net with tiny buckets
  (bucket_cap_mb=0.001), each rank half the batch, equals the net trained on the whole batch, and
  torch's DDP, for 2 iterations (parameters updated by hand, grads set to None).
- test_ignored_output (and _with_unused_parameters): forwards whose output is dropped without a
  backward, then forwards with a backward, train equal to torch's DDP.
- test_ddp_comm_hook_future_passing_cpu, test_ddp_invalid_comm_hook_init,
  test_ddp_invalid_comm_hook_return_type, test_ddp_comm_hook_register_just_once: in
  test_torch_hook_checks.py.
- test_sparse_gradients (and _grad_is_view): sparse grads (an EmbeddingBag(sparse=True)) reduced
  as sparse (issue 35 item 4; more in test_torch_sparse.py). test_ddp_comm_hook_sparse_gradients:
  a hook written for torch (an all-reduce on the torch group, then a division by the group size)
  gets the sparse grad in a bucket of its own, as torch's reducer hands it over, and its result
  is the grad: the local model's on the whole batch, bitwise torch DDP's with the same hook
  (issue 43 item 4; more in test_torch_sparse.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_gloo import beside_torch, on_two_ranks

pytest.importorskip("torch", reason="PyTorch is not installed")


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(  # c10d's Net: 2 -> 10 -> 50 -> 4, no bias, softmax
        torch.nn.Linear(2, 10, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(10, 50, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(50, 4, bias=False),
        torch.nn.Softmax(dim=1),
    )


def _gloo_backend_cpu_module(ddp_class, group, rank: int, view: bool) -> dict:
    """test_c10d_common's _test_ddp_with_process_group on one CPU device per rank."""
    import copy

    import torch

    local = _net()
    ddp = ddp_class(
        copy.deepcopy(local), process_group=group, bucket_cap_mb=0.001, gradient_as_bucket_view=view
    )
    torch.manual_seed(1)
    x, y = torch.randn(2, 2), torch.randn(2, 4)
    out = {}
    for it in range(2):
        for model, (xs, ys) in ((local, (x, y)), (ddp, (x[rank : rank + 1], y[rank : rank + 1]))):
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            for p in model.parameters():
                with torch.no_grad():
                    p -= p.grad
                p.grad = None
        out[it] = [
            (a.detach().numpy().copy(), b.detach().numpy().copy())
            for a, b in zip(local.parameters(), ddp.parameters())
        ]
        torch.manual_seed(1337 + it)
        x = x[torch.randperm(2)]
    return out


def _ignored_output(ddp_class, group, unused: bool) -> list:
    import torch

    torch.manual_seed(2)
    layers = [torch.nn.Linear(2, 10, bias=False), torch.nn.ReLU(), torch.nn.Linear(10, 4, bias=False)]
    module = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Softmax(dim=1))
    if unused:
        module.unused = torch.nn.Linear(4, 4, bias=False)  # never in the forward
    model = ddp_class(module, process_group=group, find_unused_parameters=unused)
    g = torch.Generator().manual_seed(3)
    x, target = torch.rand(4, 2, generator=g), torch.randint(0, 4, (4,), generator=g)
    for _ in range(4):  # forwards whose output is dropped: no backward, no hang
        model(x)
    grads = []
    for _ in range(4):
        torch.nn.functional.cross_entropy(model(x), target).backward()
        grads.append([p.grad.numpy().copy() for p in model.parameters() if p.grad is not None])
    return grads


def _c10d(rank: int, world: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    out: dict = {}
    with beside_torch(rank, world, store, explicit_store=True):
        group = dist.distributed_c10d._get_default_group()
        for who, ddp in (("torch", TorchDDP), ("ours", nd.DistributedDataParallel)):
            for view in (False, True):
                out["cpu module", view, who] = _gloo_backend_cpu_module(ddp, group, rank, view)
            for unused in (False, True):
                out["ignored output", unused, who] = _ignored_output(ddp, group, unused)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_c10d_gloo_cpu_behaviours(tmp_path):
    for r in on_two_ranks(_c10d, tmp_path):
        for view in (False, True):
            for it, pairs in r["cpu module", view, "ours"].items():
                for (local, ours), (_, theirs) in zip(pairs, r["cpu module", view, "torch"][it]):
                    np.testing.assert_allclose(ours, local, rtol=1.3e-6, atol=5e-5)  # c10d's bound
                    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        for unused in (False, True):
            ours, theirs = r["ignored output", unused, "ours"], r["ignored output", unused, "torch"]
            assert len(ours) == len(theirs) == 4
            for a, b in zip(ours, theirs):
                assert len(a) == len(b)
                for x, y in zip(a, b):
                    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def _sparse_gradient_module():
    import torch

    class SparseGradientModule(torch.nn.Module):  # c10d's: an EmbeddingBag, then softmax
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.EmbeddingBag(10, 10, sparse=True)

        def forward(self, x):
            return torch.nn.functional.softmax(self.embedding(x), dim=1)

    return SparseGradientModule()


def _sparse_grads(ddp_class, group, rank: int, world: int, hooked: bool) -> dict:
    """c10d's _run_and_verify_sparse_gradients: the local model on the whole batch, the DDP one
    on this rank's half; both grads, coalesced; with `hooked`, c10d's allreduce_hook_gloo."""
    import copy

    import torch

    torch.manual_seed(1337)
    vanilla = _sparse_gradient_module()
    ddp = ddp_class(copy.deepcopy(vanilla), process_group=group)
    if hooked:

        def allreduce_hook_gloo(state: object, bucket):
            fut = group.allreduce([bucket.buffer()]).get_future()
            return fut.then(lambda f: f.wait()[0] / world)

        ddp.register_comm_hook(None, allreduce_hook_gloo)
    criterion = torch.nn.CrossEntropyLoss()
    x, y = torch.randint(0, 10, [2 * world, 2]), torch.randint(0, 10, [2 * world])
    criterion(vanilla(x), y).backward()
    criterion(ddp(x.split(2)[rank]), y.split(2)[rank]).backward()
    out = {}
    for who, p in (("local", next(vanilla.parameters())), ("ddp", next(ddp.parameters()))):
        g = p.grad.coalesce()
        out[who] = (p.grad.is_sparse, g.indices().numpy().copy(), g.values().numpy().copy())
    return out


def _sparse(rank: int, world: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    out = {}
    with beside_torch(rank, world, store, explicit_store=True):
        group = dist.distributed_c10d._get_default_group()
        for who, ddp in (("torch", TorchDDP), ("ours", nd.DistributedDataParallel)):
            for hooked in (False, True):
                out[who, hooked] = _sparse_grads(ddp, group, rank, world, hooked)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sparse_gradients_stay_sparse_with_and_without_a_comm_hook(tmp_path):
    for r in on_two_ranks(_sparse, tmp_path):
        for hooked in (False, True):
            ours, theirs = r["ours", hooked], r["torch", hooked]
            assert ours["ddp"][0] and theirs["ddp"][0]  # sparse
            np.testing.assert_array_equal(ours["ddp"][1], ours["local"][1])  # the rows
            np.testing.assert_allclose(ours["ddp"][2], ours["local"][2], rtol=1.3e-6, atol=1e-5)  # c10d's
            if hooked:  # the same hook on the same grads: torch's result, bit for bit
                np.testing.assert_array_equal(ours["ddp"][1], theirs["ddp"][1])
                np.testing.assert_array_equal(ours["ddp"][2], theirs["ddp"][2])
            else:
                np.testing.assert_allclose(ours["ddp"][2], theirs["ddp"][2], rtol=1e-6, atol=1e-7)
