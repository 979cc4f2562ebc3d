"""fully_shard(shard_placement_fn=...): parameters sharded along the dim the callable returns
(torch FSDP2's `Shard(dim)`), 2 and 3 ranks. Against torch's own fully_shard with the same
callable (largest dim: its test MLP and its test Transformer per block; torch shards a dim > 0
evenly only): losses and trained parameters equal bit for bit. On uneven sizes (dim 1 of 5 over
2 and 3 ranks, one rank holding none, a 3-D parameter cut in its middle dim; torch refuses
those) against torch's dim-0 sharding, which trains the same values: equal bit for bit on 2
ranks, to 1e-5 on 3 (another summation order). The local shard is torch.chunk's chunk on the
dim, contiguous, its grad too; a state dict holds Shard(d) DTensors and a DCP checkpoint of
them loads into dim-0 models (ours and torch's); bad returns raise on every rank naming it."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import full_params, gloo, shard_blocks, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import outcome, run_ranks  # noqa: E402

STEPS = 8


def largest(p):
    """torch's tests' placement: the parameter's largest dim (the first of equal ones)."""
    from torch.distributed.tensor import Shard

    return Shard(p.shape.index(max(p.shape)))


def dim1(p):
    """Dim 1 of every parameter that has one (as a negative dim: -1 of a 2-D one), else dim 0."""
    from torch.distributed.tensor import Shard

    return Shard(1 - p.dim()) if p.dim() == 2 else Shard(1) if p.dim() > 2 else None


def _mlp():
    """torch's test_train_parity_single_group_shard_largest_dim model (weights cut on dim 1)."""
    torch.manual_seed(42)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


class Odd(torch.nn.Module):
    """Weights whose dim 1 (5, 6, 4) does not split evenly over 2 or 3 ranks, and a 3-D one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin1 = torch.nn.Linear(5, 6)  # weight (6, 5)
        self.lin2 = torch.nn.Linear(6, 4)  # weight (4, 6)
        self.cube = torch.nn.Parameter(torch.randn(3, 4, 2))  # dim 1: none on a third rank

    def forward(self, x):
        z = self.lin2(torch.relu(self.lin1(x)))
        return z.sum(-1) + torch.einsum("bj,ijk->bik", x[:, :4], self.cube).sum((1, 2))


def _odd_sharded(fs, fn):
    m = Odd()
    fs(m.lin1, shard_placement_fn=fn)
    fs(m, shard_placement_fn=fn)
    return m


def _vectors(rank, steps, width):
    g = torch.Generator().manual_seed(200 + rank)
    return [[torch.randn(4, width, generator=g)] for _ in range(steps)]


def _run(model, data):
    res = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), data)
    res["params"] = full_params(model)
    return res


def _locals(model, rank, world, fn):
    """Each parameter's placement, local shape and contiguity (and its grad's after one
    backward), and whether its local values are torch.chunk's chunk of the full tensor."""
    out: dict = {"unsharded_contiguous": []}

    def unsharded(module, args):  # torch's check: the parameters forward computes with
        out["unsharded_contiguous"] += [p.is_contiguous() for p in module.parameters()]

    model.lin1.register_forward_pre_hook(unsharded)
    model.lin2.register_forward_pre_hook(unsharded)
    model(torch.ones(2, 5)).sum().backward()
    for name, p in model.named_parameters():
        full = p.full_tensor()
        chunks = torch.chunk(full, world, dim=p.placements[0].dim)
        want = chunks[rank] if rank < len(chunks) else full.narrow(p.placements[0].dim, 0, 0)
        local = p.to_local()
        out[name] = {
            "placements": [str(x) for x in p.placements],
            "shape": tuple(local.shape),
            "equal": bool(local.shape == want.shape and torch.equal(local, want)),
            "contiguous": [p.is_contiguous(), local.is_contiguous()],
            "grad": [
                tuple(p.grad.to_local().shape),
                p.grad.is_contiguous(),
                p.grad.to_local().is_contiguous(),
            ],
        }
    return out


def _two(rank: int, world: int, store_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import nccl_ddp as nd

    out: dict = {}
    with gloo(rank, world, store_dir):
        impls = dict(torch_and_ours())
        for who, fs in impls.items():
            m = _mlp()
            fs(m, shard_placement_fn=largest)
            out[f"mlp-{who}"] = _run(m, _vectors(rank, STEPS, 32))
            t = shard_blocks(transformer(), fs, shard_placement_fn=largest)
            out[f"transformer-{who}"] = _run(t, tokens(rank, STEPS))
            t = shard_blocks(transformer(), fs, shard_placement_fn=largest)
            out[f"placements-{who}"] = {n: [str(x) for x in p.placements] for n, p in t.named_parameters()}
        out["odd-ours"] = _run(_odd_sharded(nd.fully_shard, dim1), _vectors(rank, STEPS, 5))
        out["odd-torch-dim0"] = _run(_odd_sharded(impls["torch"], None), _vectors(rank, STEPS, 5))
        out["locals"] = _locals(_odd_sharded(nd.fully_shard, dim1), rank, world, dim1)
        # cast to float64 after fully_shard (recast.py): the dim-1 shards laid out again on dim 1
        data64 = [[x.double() for x in batch] for batch in _vectors(rank, STEPS, 5)]
        out["odd64-ours"] = _run(_odd_sharded(nd.fully_shard, dim1).to(torch.float64), data64)
        out["odd64-torch-dim0"] = _run(_odd_sharded(impls["torch"], None).to(torch.float64), data64)
        # state dict and DCP: saved with dim-1 shards, loaded into dim-0 ones (ours and torch's)
        m = _odd_sharded(nd.fully_shard, dim1)
        train(m, torch.optim.Adam(m.parameters(), lr=1e-2), _vectors(rank, 2, 5))
        sd = get_model_state_dict(m)
        out["state_dict"] = {
            k: [str(x) for x in v.placements] + [tuple(v.to_local().shape)] for k, v in sd.items()
        }
        path = os.path.join(store_dir, "dcp")
        dcp.save({"model": sd}, checkpoint_id=path)
        out["saved"] = full_params(m)
        out["loaded"] = {}
        for who, fs in impls.items():
            fresh = _odd_sharded(fs, None)
            state = {"model": get_model_state_dict(fresh)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(fresh, state["model"])
            out["loaded"][who] = full_params(fresh)
        # and loaded back into a dim-1 one of ours, then trained on: as the saved model goes on
        back = _odd_sharded(nd.fully_shard, dim1)
        state = {"model": get_model_state_dict(back)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(back, state["model"])
        out["loaded"]["ours-dim1"] = full_params(back)
        out["errors"] = _errors(rank)
    return out


def _errors(rank: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    import nccl_ddp as nd

    def lin():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 6)

    cases = {
        "not_a_shard": lambda: nd.fully_shard(lin(), shard_placement_fn=lambda p: Replicate()),
        "dim_out_of_range": lambda: nd.fully_shard(lin(), shard_placement_fn=lambda p: Shard(p.dim())),
        "negative_out_of_range": lambda: nd.fully_shard(lin(), shard_placement_fn=lambda p: Shard(-3)),
        "not_callable": lambda: nd.fully_shard(lin(), shard_placement_fn=Shard(1)),
        "differs_across_ranks": lambda: nd.fully_shard(
            lin(), shard_placement_fn=lambda p: Shard(rank) if p.dim() == 2 else None
        ),
    }
    return {k: outcome(f) for k, f in cases.items()}


def _three(rank: int, world: int, store_dir: str) -> dict:
    import nccl_ddp as nd

    with gloo(rank, world, store_dir):
        impls = dict(torch_and_ours())
        return {
            "ours": _run(_odd_sharded(nd.fully_shard, dim1), _vectors(rank, STEPS, 5)),
            "torch-dim0": _run(_odd_sharded(impls["torch"], None), _vectors(rank, STEPS, 5)),
            "locals": _locals(_odd_sharded(nd.fully_shard, dim1), rank, world, dim1),
        }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list:
    return run_ranks(_two, 2, str(tmp_path_factory.mktemp("fsdp-placement2")), timeout=600)


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list:
    return run_ranks(_three, 3, str(tmp_path_factory.mktemp("fsdp-placement3")), timeout=400)


pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]


def _same(ours, ref, where):
    assert len(ours["losses"]) == STEPS
    assert ours["losses"] == ref["losses"], where
    for name, value in ref["params"].items():
        np.testing.assert_array_equal(ours["params"][name], value, err_msg=f"{where} {name}")


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_largest_dim_trains_as_torch_fully_shard(two, model):
    for rank, res in enumerate(two):
        _same(res[f"{model}-ours"], res[f"{model}-torch"], f"rank {rank}")
        assert res[f"{model}-ours"]["params"] != {}
    assert two[0][f"{model}-ours"]["losses"] != two[1][f"{model}-ours"]["losses"]  # ranks differ


def test_largest_dim_placements_are_torchs(two):
    ours, ref = two[0]["placements-ours"], two[0]["placements-torch"]
    assert ours == ref
    assert ours["layers.0.feed_forward.w2.weight"] == ["S(1)"]  # (32, 128): dim 1
    assert ours["tok_embeddings.weight"] == ["S(0)"]


def test_uneven_dim1_trains_as_dim0_sharding(two, three):
    for rank, res in enumerate(two):
        _same(res["odd-ours"], res["odd-torch-dim0"], f"2 ranks, rank {rank}")
    for rank, res in enumerate(three):
        ours, ref = res["ours"], res["torch-dim0"]
        np.testing.assert_allclose(
            ours["losses"], ref["losses"], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}"
        )
        for name, value in ref["params"].items():
            np.testing.assert_allclose(ours["params"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_cast_after_fully_shard_keeps_the_shard_dims(two):
    for rank, res in enumerate(two):
        _same(res["odd64-ours"], res["odd64-torch-dim0"], f"float64, rank {rank}")


def test_local_shard_is_torch_chunk_on_its_dim(two, three):
    # (rows of dim 1 per rank) lin1.weight (6, 5), lin2.weight (4, 6), cube (3, 4, 2)
    want = {
        2: {"lin1.weight": [(6, 3), (6, 2)], "lin2.weight": [(4, 3), (4, 3)], "cube": [(3, 2, 2), (3, 2, 2)]},
        3: {
            "lin1.weight": [(6, 2), (6, 2), (6, 1)],
            "lin2.weight": [(4, 2), (4, 2), (4, 2)],
            "cube": [(3, 2, 2), (3, 2, 2), (3, 0, 2)],
        },
    }
    for world, ranks in ((2, two), (3, three)):
        for rank, res in enumerate(ranks):
            local = dict(res["locals"])
            assert local.pop("unsharded_contiguous") == [True] * 4, (world, rank)
            for name, info in local.items():
                where = (world, rank, name)
                assert info["equal"], where
                assert info["contiguous"] == [True, True], where
                assert info["grad"] == [info["shape"], True, True], where
                if name in want[world]:
                    assert info["placements"] == ["S(1)"], where
                    assert info["shape"] == want[world][name][rank], where
                else:  # biases: None from the callable, dim 0
                    assert info["placements"] == ["S(0)"], where


def test_state_dict_and_dcp_hold_the_dim1_shards(two):
    for rank, res in enumerate(two):
        sd = res["state_dict"]
        assert sd["lin1.weight"] == ["S(1)", (6, 3 - rank)]
        assert sd["cube"] == ["S(1)", (3, 2, 2)]
        assert sd["lin1.bias"] == ["S(0)", (3,)]
        for who, got in res["loaded"].items():
            for name, value in res["saved"].items():
                np.testing.assert_array_equal(got[name], value, err_msg=f"rank {rank} {who} {name}")


@pytest.mark.parametrize(
    "case,error,words",
    [
        ("not_a_shard", "ConfigError", ["'weight'", "Replicate()", "Shard(dim)", "or None"]),
        ("dim_out_of_range", "ConfigError", ["'weight'", "(6, 4)", "no dim 2", "-2 <= d < 2"]),
        ("negative_out_of_range", "ConfigError", ["'weight'", "no dim -3", "-2 <= d < 2"]),
        ("not_callable", "ConfigError", ["callable", "Shard(dim) or None"]),
        ("differs_across_ranks", "RankMismatchError", ["shard_placement_fn dims"]),
    ],
)
def test_bad_placements_named_on_every_rank(two, case, error, words):
    for rank, res in enumerate(two):
        kind, msg = res["errors"][case]
        assert kind == error, (rank, kind, msg)
        assert f"rank {rank}" in msg, msg
        for w in words:
            assert w in msg, (w, msg)
