"""Sparse grads (Embedding / EmbeddingBag with sparse=True) reduced as torch's DDP on gloo reduces
them (issue 35 item 4), on 2 CPU processes with torch.distributed started first: each rank looks
up different rows, and `p.grad` comes back sparse with torch's indices and values, beside a dense
layer reduced through the buckets; no_sync() accumulates locally as torch's does. A comm hook
written for torch gets each sparse grad in a bucket of its own, as torch's reducer hands it over,
and its result becomes `p.grad`: bitwise torch DDP's with the same hook (torch's allreduce_hook,
fused into ours, as well); one returning no sparse grad of the parameter's shape is named. ZeRO,
compressing comm hooks (dense grads only) and Join (a joined rank cannot stand in for the
all-gathers) refuse such a model naming the parameter."""

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


def _mean_hook(state, bucket):
    """A hook written for torch (c10d's test_ddp_comm_hook_sparse_gradients has it): the bucket
    all-reduced with torch.distributed, then divided by the group size; it records what it saw."""
    import torch.distributed as dist

    b = bucket.buffer()
    SEEN.append((bucket.index(), bucket.is_last(), b.is_sparse, len(bucket.gradients()), bucket.parameters()))
    fut = dist.all_reduce(b, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / dist.get_world_size())


SEEN: list = []  # (index, is_last, sparse buffer, len(gradients()), parameters) per bucket, per rank


def _buckets_seen(model) -> dict:
    """What `_mean_hook` saw in a step: the bucket indices, the last one's, and per sparse
    parameter (by name) whether its bucket held just it, its grad as a sparse buffer."""
    names = {id(p): n for n, p in model.named_parameters()}
    sparse = {}
    for _, _, is_sparse, n_grads, params in SEEN:
        if is_sparse:
            assert len(params) == 1 and n_grads == 0  # torch's sparse bucket: no dense views
            sparse[names[id(params[0])]] = True
    out = {
        "indices": sorted(i for i, *_ in SEEN),
        "last": [i for i, last, *_ in SEEN if last],
        "sparse": sparse,
    }
    SEEN.clear()
    return out


def _hooked(rank: int, world: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    hooks = {
        "mean hook": (None, _mean_hook),
        "torch's allreduce_hook": (None, default_hooks.allreduce_hook),  # ours, fused
        "allreduce_hook on torch's group": ("group", default_hooks.allreduce_hook),  # torch's own
    }
    out: dict = {}
    with beside_torch(rank, world, store):
        for kind in ("embedding", "bag"):
            for name, (state, hook) in hooks.items():
                for no_sync in (False, True):
                    for who, cls in (("torch", TorchDDP), ("ours", nd.DistributedDataParallel)):
                        ddp = cls(_model(kind))
                        ddp.register_comm_hook(dist.group.WORLD if state else None, hook)
                        SEEN.clear()
                        out[kind, name, no_sync, who] = _train(ddp, rank, no_sync)
                        out[kind, name, no_sync, who, "seen"] = _buckets_seen(ddp.module)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_comm_hooks_reduce_sparse_grads_bitwise_as_torch_ddp(tmp_path):
    """c10d's test_ddp_comm_hook_sparse_gradients on models with a dense layer too: the grads
    after every backward (and under no_sync()) are bitwise torch DDP's with the same hook."""
    ranks = on_two_ranks(_hooked, tmp_path)
    for r in ranks:
        for key in [k for k in r if len(k) == 4 and k[3] == "ours"]:
            ours, theirs = r[key], r[(*key[:3], "torch")]
            assert len(ours) == len(theirs) == (4 if key[2] else 2)
            for a, b in zip(ours, theirs):
                assert a.keys() == b.keys()
                for n in a:
                    assert a[n][0] == b[n][0] and a[n][0] == (n == "emb.weight"), (key, n)
                    if a[n][0]:
                        np.testing.assert_array_equal(a[n][1], b[n][1], err_msg=f"{key} {n}")
                    np.testing.assert_array_equal(a[n][2], b[n][2], err_msg=f"{key} {n}")
            if key[1] == "mean hook":  # the buckets it saw: each sparse grad in one of its own
                seen, torch_seen = r[(*key, "seen")], r[(*key[:3], "torch", "seen")]
                assert seen["sparse"] == torch_seen["sparse"] == {"emb.weight": True}
                for s in (seen, torch_seen):  # 2 steps, indices 0..n-1 each, one last: the highest
                    n = len(s["indices"]) // 2
                    assert s["indices"] == sorted(list(range(n)) * 2)
                    assert s["last"] == [n - 1, n - 1]
    for key in [k for k in ranks[0] if len(k) == 4]:  # every rank holds the same grads
        _check_equal(
            [g for i, g in enumerate(ranks[0][key]) if not key[2] or i % 2],
            [g for i, g in enumerate(ranks[1][key]) if not key[2] or i % 2],
        )


def _one_step(ddp) -> None:
    import torch

    x = torch.randint(0, 20, (3, 4))
    torch.nn.functional.cross_entropy(ddp(x), torch.zeros(3, dtype=torch.long)).backward()


def _wrong_results() -> dict:
    """What each hook that returns no sparse grad of the parameter raised at backward."""
    import torch

    import nccl_ddp as nd

    def returning(value):
        def hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(value(bucket) if bucket.buffer().is_sparse else bucket.buffer())
            return fut

        return hook

    def no_future(state, bucket):  # (for the sparse bucket: the dense one gets its future)
        return bucket.buffer() if bucket.buffer().is_sparse else returning(lambda b: b)(state, bucket)

    cases = {
        "dense": returning(lambda b: b.buffer().to_dense()),
        "shape": returning(
            lambda b: torch.sparse_coo_tensor(
                torch.zeros((1, 1), dtype=torch.long), torch.ones(1, 5), (20, 5)
            )
        ),
        "dtype": returning(lambda b: b.buffer().double()),
        "list of 2": returning(lambda b: [b.buffer(), b.buffer()]),
        "no future": no_future,
    }
    out = {}
    for case, hook in cases.items():
        ddp = nd.DistributedDataParallel(_model("embedding"))
        ddp.register_comm_hook(None, hook)
        out[case] = raised(lambda: _one_step(ddp))
        ddp.close()
    return out


def _message(got, kind: type, rank: int, case: str) -> str:
    """The message of what `raised` caught, checked to be a `kind` naming the rank and the
    parameter."""
    assert got is not None, case
    cls, message = got
    assert issubclass(cls, kind), (case, cls, message)
    assert f"rank {rank}" in message and "'emb.weight'" in message, message
    return message


def _misuses(rank: int, world: int, store: str) -> dict:
    with beside_torch(rank, world, store):
        return {**_refusals(), "results": _wrong_results()}


@pytest.fixture(scope="module")
def misuses(tmp_path_factory) -> list:
    """Per rank: the refusals (`_refusals`) and the hooks' wrong results (under "results")."""
    return on_two_ranks(_misuses, tmp_path_factory.mktemp("misuses"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hook_returning_no_sparse_grad_is_named(misuses):
    from nccl_ddp.errors import CommHookError

    for rank, r in enumerate(misuses):
        r = r["results"]
        for case, got in r.items():
            message = _message(got, CommHookError, rank, case)
            assert f"rank {rank}: comm hook " in message and "parameter 'emb.weight'" in message, message
            if case == "no future":
                assert "torch.futures.Future" in message, message
            else:  # what to return
                assert "torch.sparse_coo tensor of shape (20, 6), torch.float32 on cpu" in message, message
        assert "torch.sparse_coo tensor of shape (20, 5)" in r["shape"][1]
        assert "torch.strided tensor" in r["dense"][1]


def _refusals() -> dict:
    """What refused a model with sparse grads, and that it trains all the same."""
    import torch
    import torch.distributed as dist
    import torch.distributed.algorithms.join
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import nccl_ddp as nd

    out = {"zero": raised(lambda: nd.DistributedDataParallel(_model("bag"), zero=nd.ZeroConfig(stage=1)))}
    ddp = nd.DistributedDataParallel(_model("embedding"))
    out["hook"] = raised(lambda: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook))
    out["ours"] = raised(lambda: ddp.register_comm_hook(None, nd.hooks.bf16_compress))
    out["builtin"] = raised(lambda: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS))
    out["optimizer"] = raised(
        lambda: nd.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    )
    out["join"] = raised(lambda: nd.Join([ddp]))
    out["torch join"] = raised(lambda: torch.distributed.algorithms.join.Join([ddp]))
    _one_step(ddp)  # the wrapper still trains after the refusals
    out["trains"] = ddp.module.emb.weight.grad.is_sparse and ddp.reducer.comm_hook is None
    ddp.close()
    ddp = nd.DistributedDataParallel(_model("embedding"))  # the all-reduce built-in takes them
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    _one_step(ddp)
    out["builtin allreduce"] = ddp.module.emb.weight.grad.is_sparse
    ddp.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_compressing_hooks_and_join_refuse_sparse_grads_naming_the_parameter(misuses):
    from nccl_ddp.errors import ConfigError

    for rank, r in enumerate(misuses):
        for what, name in (
            ("zero", "ZeRO"),
            ("hook", "register_comm_hook(fp16_compress_hook)"),
            ("ours", "register_comm_hook(bf16_compress_hook)"),
            ("builtin", "register_builtin_comm_hook(BuiltinCommHookType.FP16_COMPRESS)"),
            ("optimizer", "ZeroRedundancyOptimizer"),
            ("join", "Join"),
            ("torch join", "Join"),
        ):
            message = _message(r[what], ConfigError, rank, what)
            assert name in message and "sparse=False" in message, message
            if what in ("hook", "ours", "builtin"):
                assert "torch's allreduce_hook" in message, message
        assert r["trains"] and r["builtin allreduce"]
