"""Ours as a drop-in for torch's DistributedDataParallel (gloo, CPU, 2 ranks): the same models and
training loops under both must end with the same parameters AND buffers on every rank.

Scenarios (tests/torch_oracle.py): a BatchNorm CNN, a frozen-backbone fine-tune, a tied-weight
model, AdamW with parameter groups + gradient clipping + bf16 autocast, gradient accumulation with
no_sync(); every loop also runs an evaluation forward under torch.no_grad() after each step,
which decides (as in torch) whether the next forward broadcasts the buffers.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from torch_oracle import MODELS, Scenario, gloo_group, run_torch_scenario, train_scenario  # noqa: E402

WORLD = 2
SCENARIOS = {
    "bn_cnn": Scenario("bn_cnn"),
    "bn_cnn-no_sync": Scenario("bn_cnn", accumulate=3),
    "frozen_backbone": Scenario("frozen_backbone"),
    "tied": Scenario("tied"),
    "adamw-clip-bf16": Scenario("bn_cnn", optimizer="adamw", clip=0.5, bf16_autocast=True),
    "frozen-adamw-no_sync": Scenario("frozen_backbone", accumulate=2, optimizer="adamw",
                                     clip=1.0),
}


def _oracle(rank: int, world: int, scenarios: dict, store_dir: str) -> dict:
    import nccl_ddp as nd

    torch.set_num_threads(1)
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        references = {name: run_torch_scenario(rank, s) for name, s in scenarios.items()}
    out = {}
    nd.init_process_group("host")
    try:
        for name, scenario in scenarios.items():
            module = MODELS[scenario.model](rank)
            ddp = nd.DistributedDataParallel(module)
            out[name] = (references[name], train_scenario(ddp, module, rank, scenario))
            ddp.close()
    finally:
        nd.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return run_ranks(_oracle, WORLD, SCENARIOS, str(tmp_path_factory.mktemp("gloo")),
                     timeout=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_params_and_buffers_match_torch_ddp(name, oracle):
    for rank, results in enumerate(oracle):
        reference, ours = results[name]
        assert set(ours) == set(reference)
        for key in reference:
            np.testing.assert_allclose(ours[key], reference[key], rtol=1e-6, atol=1e-6,
                                       err_msg=f"rank {rank} {name}: {key}")
    # parameters end equal on both ranks (buffers not: the last forward updates them locally)
    module = MODELS[SCENARIOS[name].model](0)
    for key, _ in module.named_parameters():
        np.testing.assert_array_equal(oracle[0][name][1][key], oracle[1][name][1][key], key)
