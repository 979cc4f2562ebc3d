"""nccl_ddp.horovod.torch.DistributedOptimizer on 2 ranks: grads matched by parameter name
(whatever order each rank lists them in; different names refused on every rank), several param
groups without named_parameters, a rank outside process_set, and sparse embedding grads."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import error_of, run_ranks  # noqa: E402

WORLD = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # equal sizes: mixable


def _local_grads(model, x) -> list:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _expected_mean(hvd, model, x) -> list:
    """The mean over the ranks of each parameter's local grad (the oracle)."""
    everyone = hvd.allgather_object([g.numpy() for g in _local_grads(model, x)])
    return [np.mean([grads[i] for grads in everyone], axis=0) for i in range(len(everyone[0]))]


def _optimizer(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    hvd.init()
    out: dict = {}
    torch.manual_seed(10 + rank)
    x = torch.randn(3, 4)
    # the same named parameters, in another order on rank 1 (the optimizer's and the names'):
    # matched by name (on main each rank laid its buckets out in its own order: mixed grads)
    model = _model()
    want = _expected_mean(hvd, model, x)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params if rank == 0 else params[::-1], lr=0.1),
        named_parameters=named if rank == 0 else named[::-1],
    )
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.synchronize()
    out["order"] = max(float(np.abs(p.grad.numpy() - w).max()) for p, w in zip(model.parameters(), want))
    with opt.skip_synchronize():
        opt.step()
    # different names on one rank: refused on every rank, naming them
    other = _model()
    names = [
        (("renamed." if rank else "") + k if k == "0.bias" else k, v) for k, v in other.named_parameters()
    ]
    out["names"] = error_of(
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), named_parameters=names)
    )
    # several param groups, no named_parameters
    groups = _model()
    want = _expected_mean(hvd, groups, x)
    sgd = torch.optim.SGD(
        [{"params": groups[0].parameters()}, {"params": groups[1].parameters(), "lr": 0.2}], lr=0.1
    )
    opt = hvd.DistributedOptimizer(sgd)
    out["group_names"] = sorted(opt._parameter_names.values())
    opt.zero_grad()
    groups(x).pow(2).sum().backward()
    opt.synchronize()
    out["groups"] = max(float(np.abs(p.grad.numpy() - w).max()) for p, w in zip(groups.parameters(), want))
    with opt.skip_synchronize():
        opt.step()
    # a rank outside process_set trains on its own grads
    alone = hvd.add_process_set([0])
    solo = _model()
    local = _local_grads(_model(), x)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(solo.parameters(), lr=0.1), process_set=alone)
    opt.zero_grad()
    solo(x).pow(2).sum().backward()
    opt.step()
    out["outside"] = max(float((p.grad - g).abs().max()) for p, g in zip(solo.parameters(), local))
    # sparse embedding grads: gathered (and sparse_as_dense: reduced dense), averaged
    for dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        idx = torch.tensor([[1, 2, 2]]) if rank == 0 else torch.tensor([[2, 5]])
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), sparse_as_dense=dense
        )
        opt.zero_grad()
        emb(idx).sum().backward()
        opt.synchronize()
        g = emb.weight.grad
        out[f"sparse_{dense}"] = (g.is_sparse, g.to_dense().tolist())
        with opt.skip_synchronize():
            opt.step()
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def optimizer():
    return run_ranks(_optimizer, WORLD, timeout=120)


@pytest.mark.slow
def test_grads_are_matched_by_parameter_name(optimizer):
    for r in optimizer:
        assert r["order"] < 1e-6  # the mean of the ranks' grads, though rank 1 listed them reversed
        assert r["names"].startswith("RankMismatchError") and "renamed.0.bias" in r["names"]
        assert "grads are matched by name" in r["names"]


@pytest.mark.slow
def test_param_groups_process_set_outsiders_and_sparse_grads(optimizer):
    for r in optimizer:
        assert r["group_names"] == sorted(f"allreduce.noname.{i}" for i in range(4))  # one counter
        assert r["groups"] < 1e-6
        assert r["outside"] < 1e-6
        # rank 0 looks up rows 1, 2, 2 and rank 1 rows 2, 5: the mean of the two sums
        want = np.zeros((6, 2))
        want[1], want[2], want[5] = 0.5, 1.5, 0.5
        for dense in (False, True):
            is_sparse, grad = r[f"sparse_{dense}"]
            assert is_sparse and np.allclose(grad, want)
