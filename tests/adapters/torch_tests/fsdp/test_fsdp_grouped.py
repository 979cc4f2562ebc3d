"""`nccl_ddp.fully_shard([a, b])`: one unit over a list of modules (FSDP2's grouping: gathered
before the first of them runs forward, resharded after the last), held to torch's own
fully_shard of the same list over gloo: the tied embedding and output head of torch's test
Transformer as one unit (torch's test_train_shared_params_uneven_shard shards them so), and two
modules with others between them."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import assert_same_run, full_params, gloo, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402


def _tied(fs):
    """Blocks, then [tok_embeddings, output] (one weight) as one unit, then the root."""
    model = transformer(2, weight_tying=True)
    for block in model.layers:
        fs(block)
    fs([model.tok_embeddings, model.output])
    fs(model)
    return model


def _apart(fs):
    """Linear 0 and Linear 4 as one unit, the Linear between them its own, then the root."""
    torch.manual_seed(42)
    layers = [torch.nn.Embedding(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 64))
    fs(model[2])
    fs([model[0], model[4]])
    fs(model)
    return model


def _list_unit(model, name):
    return (model.output if name == "tied" else model[4])._nccl_unit()


def _grouped(rank: int, world: int, store_dir: str) -> dict:
    import nccl_ddp as nd

    out = {}
    with gloo(rank, world, store_dir):
        for name, build in (("tied", _tied), ("apart", _apart)):
            for who, fs in torch_and_ours():
                model = build(fs)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                res = train(model, opt, tokens(rank, 5))
                res["params"] = full_params(model)
                res["classes"] = [type(m).__name__ for m in model.modules() if isinstance(m, nd.FSDPModule)]
                if who == "ours":  # the list's unit: gathered once per forward and once per backward
                    res["gathers"] = _list_unit(model, name).times.gathers
                out[name, who] = res
    return out


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_one_unit_over_a_list_of_modules_like_torch(tmp_path):
    ranks = run_ranks(_grouped, 2, str(tmp_path), timeout=240)
    for (rank, got), name in itertools.product(enumerate(ranks), ("tied", "apart")):
        assert_same_run(got[name, "ours"], got[name, "torch"], ("losses",), (rank, name))
        assert got[name, "ours"]["gathers"] == 2 * 5, (rank, name)  # per step: forward, backward
    for got in ranks:
        assert got["apart", "ours"]["classes"] == [
            "FSDPSequential",
            "FSDPEmbedding",
            "FSDPLinear",
            "FSDPLinear",
        ]
