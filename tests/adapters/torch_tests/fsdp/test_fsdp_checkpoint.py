"""Checkpoints of a nccl_ddp.fully_shard model, 2 ranks: a full state dict on rank 0
(torch.distributed.checkpoint.state_dict's full_state_dict + cpu_offload) equal to torch
fully_shard's and to the unsharded model's keys; torch.distributed.checkpoint saves the sharded
model and optimizer state and loads them into a fresh model (ours, and torch's fully_shard:
the files are the same format), which then trains on exactly as the saved one; 3 ranks load
the 2 ranks' checkpoint (DCP reshards: 3-way shards of other sizes) to the same values."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import full_params, gloo, shard_blocks, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402


def _checkpoint(rank: int, world: int, store_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    out: dict = {}
    with gloo(rank, world, store_dir):
        impls = dict(torch_and_ours())
        full = {}
        for who, fs in impls.items():
            model = shard_blocks(transformer(), fs)
            train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens(rank, 3))
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            full[who] = {k: v.float().numpy().copy() for k, v in sd.items()}
        out["full"] = full
        out["unsharded_keys"] = sorted(transformer().state_dict())
        # save ours sharded (model + optimizer), load into a fresh one of ours and of torch's
        data = tokens(rank, 6)
        model = shard_blocks(transformer(), impls["ours"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, data[:3])
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(store_dir, "dcp")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        out["saved"] = full_params(model)
        expected = train(model, opt, data[3:])
        resumed = {}
        for who, fs in impls.items():
            fresh = shard_blocks(transformer(), fs)
            fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            train(fresh, fopt, data[:1])  # different values and a non-empty optimizer state first
            msd, osd = get_state_dict(fresh, fopt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(fresh, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            resumed[who] = train(fresh, fopt, data[3:])
            resumed[who]["params"] = full_params(fresh)
        out["expected"] = {**expected, "params": full_params(model)}
        out["resumed"] = resumed
    return out


def _load_at_three(rank: int, world: int, store_dir: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import nccl_ddp as nd

    with gloo(rank, world, store_dir):
        model = shard_blocks(transformer(), nd.fully_shard)
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        return full_params(model)


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory) -> tuple:
    store = tmp_path_factory.mktemp("fsdp-ckpt")
    return str(store), run_ranks(_checkpoint, 2, str(store), timeout=600)


@pytest.fixture(scope="module")
def ranks(saved_at_two) -> list:
    return saved_at_two[1]


pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]


def test_full_state_dict_on_rank0_equals_torch_fully_shard(ranks):
    full = ranks[0]["full"]
    assert sorted(full["ours"]) == sorted(full["torch"]) == ranks[0]["unsharded_keys"]
    for k, v in full["torch"].items():
        np.testing.assert_array_equal(full["ours"][k], v, err_msg=k)


@pytest.mark.parametrize("into", ["ours", "torch"])
def test_dcp_save_then_load_resumes_exactly(ranks, into):
    for rank, res in enumerate(ranks):
        got, want = res["resumed"][into], res["expected"]
        assert got["losses"] == want["losses"], f"rank {rank}"
        for name, value in want["params"].items():
            np.testing.assert_array_equal(got["params"][name], value, err_msg=f"rank {rank} {name}")


def test_dcp_checkpoint_of_two_ranks_loads_at_three(saved_at_two, tmp_path):
    store, two = saved_at_two
    three = run_ranks(_load_at_three, 3, str(tmp_path), os.path.join(store, "dcp"), timeout=300)
    for rank, got in enumerate(three):
        for name, value in two[0]["saved"].items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"rank {rank} {name}")
