"""Sparse grads (Embedding / EmbeddingBag with sparse=True) reduced as torch's DDP on gloo reduces
them (issue 35 item 4), on 2 CPU processes with torch.distributed started first: each rank looks
up different rows, and `p.grad` comes back sparse with torch's indices and values, beside a dense
layer reduced through the buckets; no_sync() accumulates locally as torch's does; ZeRO, comm
hooks (dense grads only) and Join (a joined rank cannot stand in for the all-gathers) refuse such
a model naming the parameter."""

from __future__ import annotations

import numpy as np
import pytest
from torch_gloo import beside_torch, on_two_ranks, raised

pytest.importorskip("torch", reason="PyTorch is not installed")


def _model(kind: str):
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "bag":
                self.emb: torch.nn.Module = torch.nn.EmbeddingBag(20, 6, mode="mean", sparse=True)
            else:
                self.emb = torch.nn.Embedding(20, 6, sparse=True)
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = self.emb(x)
            return self.head(e if kind == "bag" else e.mean(dim=1))

    torch.manual_seed(5)
    return Net()


def _grads(model) -> dict:
    """name -> (is_sparse, coalesced indices or None, values or the dense grad)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[n] = None
        elif g.is_sparse:
            c = g.coalesce()
            out[n] = (True, c.indices().numpy().copy(), c.values().numpy().copy())
        else:
            out[n] = (False, None, g.numpy().copy())
    return out


def _train(ddp, rank: int, no_sync: bool) -> list:
    """Two steps of rank-specific lookups (a no_sync() backward before each with `no_sync`);
    the grads after each backward, then SGD on them and grads set to None."""
    import contextlib

    import torch

    g = torch.Generator().manual_seed(100 + rank)
    seen = []
    for _ in range(2):
        for synced in (False, True) if no_sync else (True,):
            x = torch.randint(0, 20, (3, 4), generator=g)  # 3 bags of 4 rows, different per rank
            y = torch.randint(0, 3, (3,), generator=g)
            with contextlib.nullcontext() if synced else ddp.no_sync():
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
            seen.append(_grads(ddp.module))
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(p.grad, alpha=-0.5)
                p.grad = None
    return seen


def _both(rank: int, world: int, store: str, no_sync: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    out: dict = {}
    with beside_torch(rank, world, store):
        for kind in ("embedding", "bag"):
            for who, cls in (("torch", TorchDDP), ("ours", nd.DistributedDataParallel)):
                out[kind, who] = _train(cls(_model(kind)), rank, no_sync)
    return out


def _synced(rank: int, world: int, store: str) -> dict:
    return _both(rank, world, store, no_sync=False)


def _with_no_sync(rank: int, world: int, store: str) -> dict:
    return _both(rank, world, store, no_sync=True)


def _check_equal(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] is None) == (b[name] is None), name
            if a[name] is None:
                continue
            assert a[name][0] == b[name][0], f"{name}: sparse {a[name][0]}, torch's {b[name][0]}"
            if a[name][0]:
                np.testing.assert_array_equal(a[name][1], b[name][1])
            np.testing.assert_allclose(a[name][2], b[name][2], rtol=1e-6, atol=1e-7)


def _equal_to_torch(ranks: list) -> list:
    """(ours, torch's) grads per rank and module kind, each pair checked equal."""
    pairs = [(r[kind, "ours"], r[kind, "torch"]) for r in ranks for kind in ("embedding", "bag")]
    for ours, theirs in pairs:
        _check_equal(ours, theirs)
    return pairs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sparse_grads_equal_torch_ddp_on_gloo(tmp_path):
    ranks = on_two_ranks(_synced, tmp_path)
    for ours, theirs in _equal_to_torch(ranks):
        assert ours[0]["emb.weight"][0] and theirs[0]["emb.weight"][0]  # sparse, as torch's
        assert not ours[0]["head.weight"][0]  # the dense layer: through the buckets
    for kind in ("embedding", "bag"):  # every rank holds the same averaged grads
        _check_equal(ranks[0][kind, "ours"], ranks[1][kind, "ours"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sparse_grads_no_sync_accumulates_locally_as_torch(tmp_path):
    ranks = on_two_ranks(_with_no_sync, tmp_path)
    for ours, _ in _equal_to_torch(ranks):
        assert len(ours) == 4  # per step: after the no_sync() backward, after the synced one
        assert ours[0]["emb.weight"][0] and ours[1]["emb.weight"][0]
    for kind in ("embedding", "bag"):
        a, b = ranks[0][kind, "ours"], ranks[1][kind, "ours"]
        # under no_sync() each rank keeps its own rows; the synced step averages the sums
        assert not np.array_equal(a[0]["emb.weight"][1], b[0]["emb.weight"][1])
        _check_equal([a[1], a[3]], [b[1], b[3]])


def _refusals(rank: int, world: int, store: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.algorithms.join
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import nccl_ddp as nd

    with beside_torch(rank, world, store):
        out = {"zero": raised(lambda: nd.DistributedDataParallel(_model("bag"), zero=nd.ZeroConfig(stage=1)))}
        ddp = nd.DistributedDataParallel(_model("embedding"))
        out["hook"] = raised(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))
        out["builtin"] = raised(lambda: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE))
        out["optimizer"] = raised(
            lambda: nd.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        )
        out["join"] = raised(lambda: nd.Join([ddp]))
        out["torch join"] = raised(lambda: torch.distributed.algorithms.join.Join([ddp]))
        x = torch.randint(0, 20, (3, 4))  # the wrapper still trains after the refusals
        torch.nn.functional.cross_entropy(ddp(x), torch.zeros(3, dtype=torch.long)).backward()
        out["trains"] = ddp.module.emb.weight.grad.is_sparse
        ddp.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_comm_hooks_and_join_refuse_sparse_grads_naming_the_parameter(tmp_path):
    from nccl_ddp.errors import ConfigError

    for rank, r in enumerate(on_two_ranks(_refusals, tmp_path)):
        for what, name in (
            ("zero", "ZeRO"),
            ("hook", "register_comm_hook"),
            ("builtin", "register_builtin_comm_hook"),
            ("optimizer", "ZeroRedundancyOptimizer"),
            ("join", "Join"),
            ("torch join", "Join"),
        ):
            assert r[what] is not None, what
            kind, message = r[what]
            assert issubclass(kind, ConfigError), (what, kind, message)
            assert f"rank {rank}" in message and name in message and "'emb.weight'" in message, message
            assert "sparse=False" in message
        assert r["trains"]
