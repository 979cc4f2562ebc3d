"""Ours as a drop-in for torch's DistributedDataParallel (gloo, CPU, 2 ranks): the same models and
training loops under both must end with the same parameters AND buffers on every rank.

Scenarios (tests/support/torch_oracle.py): a BatchNorm CNN, a frozen-backbone fine-tune, a tied-weight
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
from torch_oracle import (  # noqa: E402
    MODELS,
    Scenario,
    assert_matches_torch,
    gloo_group,
    run_torch_scenario,
    scenario_batches,
    train_scenario,
)

WORLD = 2
SCENARIOS = {
    "bn_cnn": Scenario("bn_cnn"),
    "bn_cnn-no_sync": Scenario("bn_cnn", accumulate=3),
    "frozen_backbone": Scenario("frozen_backbone"),
    "tied": Scenario("tied"),
    "adamw-clip-bf16": Scenario("bn_cnn", optimizer="adamw", clip=0.5, bf16_autocast=True),
    "frozen-adamw-no_sync": Scenario("frozen_backbone", accumulate=2, optimizer="adamw", clip=1.0),
    "channels_last": Scenario("channels_last"),
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
    return run_ranks(_oracle, WORLD, SCENARIOS, str(tmp_path_factory.mktemp("gloo")), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_params_and_buffers_match_torch_ddp(name, oracle):
    assert_matches_torch(oracle, name)
    # parameters end equal on both ranks (buffers not: the last forward updates them locally)
    module = MODELS[SCENARIOS[name].model](0)
    for key, _ in module.named_parameters():
        np.testing.assert_array_equal(oracle[0][name][1][key], oracle[1][name][1][key], key)


# ---------------------------------------------------------------------------------------------
# The wrapper is what torch code expects (2 ranks, one process pair for all of it)


def _contract(rank: int, world: int, store_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    torch.set_num_threads(1)
    out: dict = {}
    short = Scenario("bn_cnn", steps=2)
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        nd.init_process_group("host")
        try:
            # --- a torch.nn.Module
            module = MODELS["bn_cnn"](rank)
            ddp = nd.DistributedDataParallel(
                module,
                device_ids=None,
                output_device=None,
                dim=0,
                broadcast_buffers=True,
                bucket_cap_mb=25,
                gradient_as_bucket_view=True,
            )
            out["isinstance"] = (
                isinstance(ddp, torch.nn.Module),
                isinstance(ddp, nd.DistributedDataParallel),
                ddp.module is module,
            )
            out["train_eval"] = (
                ddp.eval() is ddp,
                ddp.training,
                module.training,
                ddp.train() is ddp,
                ddp.training,
                module.training,
            )
            out["param_names"] = [n for n, _ in ddp.named_parameters()]
            out["same_params"] = all(a is b for a, b in zip(ddp.parameters(), module.parameters()))
            calls = []
            handle = ddp.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
            x, y = scenario_batches(rank, short)[0]
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            handle.remove()
            out["hook_calls"] = calls
            spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in ddp.reducer.memory.buffers]
            out["to_same"] = ddp.to("cpu") is ddp and ddp.to(torch.float32) is ddp
            try:
                ddp.to(torch.float64)
                out["to_double"] = None
            except ConfigError as e:
                out["to_double"] = (str(e), {p.dtype for p in module.parameters()})
            ddp.to(memory_format=torch.channels_last)  # storage changes: grads must follow
            out["conv_channels_last"] = not module[0].weight.is_contiguous()
            out["grads_in_buckets"] = all(
                any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in module.parameters()
            )
            ddp.close()

            # --- state_dict both ways against a real torch-DDP-wrapped model
            ref_module = MODELS["bn_cnn"](rank)
            ref = TorchDDP(ref_module)
            train_scenario(ref, ref_module, rank, short)
            theirs = ref.state_dict()
            mine_module = MODELS["bn_cnn"](rank + 7)
            mine = nd.DistributedDataParallel(mine_module)
            mine.load_state_dict(theirs)
            out["keys_torch_to_ours"] = (list(theirs), list(mine.state_dict()))
            out["loaded_equal"] = all(torch.equal(theirs[k], v) for k, v in mine.state_dict().items())
            # both continue from the checkpoint and stay together
            out["continued"] = (
                train_scenario(ref, ref_module, rank, short),
                train_scenario(mine, mine_module, rank, short),
            )
            back_module = MODELS["bn_cnn"](rank + 9)
            back = TorchDDP(back_module)
            back.load_state_dict(mine.state_dict())  # strict: every key must match
            out["ours_to_torch"] = all(
                torch.equal(mine.state_dict()[k], v) for k, v in back.state_dict().items()
            )
            mine.close()

            # --- parameters added or unfrozen after wrapping: refused at the next step
            grown = MODELS["frozen_backbone"](rank)
            ddp = nd.DistributedDataParallel(grown)
            grown[0].weight.requires_grad_(True)
            x, y = scenario_batches(rank, Scenario("frozen_backbone"))[0]
            try:
                ddp(x)
                out["unfrozen"] = None
            except ConfigError as e:
                out["unfrozen"] = str(e)
            grown[0].weight.requires_grad_(False)
            grown.extra = torch.nn.Linear(2, 2)
            try:
                ddp(x)
                out["added"] = None
            except ConfigError as e:
                out["added"] = str(e)
            ddp.close()
        finally:
            nd.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    return run_ranks(_contract, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=180)


@pytest.mark.slow
def test_wrapper_is_a_torch_module(contract):
    for r in contract:
        assert r["isinstance"] == (True, True, True)
        assert r["train_eval"] == (True, False, False, True, True, True)
        assert r["param_names"][0] == "module.0.weight" and all(
            n.startswith("module.") for n in r["param_names"]
        )
        assert r["same_params"]
        assert r["hook_calls"] == ["TorchDistributedDataParallel"]


@pytest.mark.slow
def test_to_keeps_or_refuses(contract):
    for r in contract:
        assert r["to_same"]
        message, dtypes = r["to_double"]
        assert "torch.float32" in message and "before wrapping" in message
        assert dtypes == {torch.float32}, "a refused conversion must change nothing"
        assert r["conv_channels_last"] and r["grads_in_buckets"]


@pytest.mark.slow
def test_state_dict_round_trip_with_torch_ddp(contract):
    for rank, r in enumerate(contract):
        theirs, ours = r["keys_torch_to_ours"]
        assert theirs == ours and theirs[0].startswith("module.")
        assert r["loaded_equal"] and r["ours_to_torch"]
        reference, mine = r["continued"]
        for key in reference:
            np.testing.assert_allclose(
                mine[key], reference[key], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {key}"
            )


@pytest.mark.slow
def test_params_changed_after_wrapping_are_refused(contract):
    for rank, r in enumerate(contract):
        assert f"rank {rank}" in r["unfrozen"] and "'0.weight'" in r["unfrozen"]
        assert "before wrapping" in r["unfrozen"]
        assert "'extra.weight'" in r["added"] and "'extra.bias'" in r["added"]


# ---------------------------------------------------------------------------------------------
# Arguments and parameters refused before any communication (no process group needed)


def test_uninitialized_lazy_parameter_is_named():
    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LazyLinear(2))
    with pytest.raises(ConfigError, match=r"'1.weight' is uninitialized.*run one forward pass"):
        nd.DistributedDataParallel(model)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device_ids": [0]}, "ConfigError", "pass device_ids=None for a CPU module"),
        ({"device_ids": [0, 1]}, "ConfigError", "one process drives one device"),
        ({"output_device": 0}, "ConfigError", "needs device_ids"),
        ({"mixed_precision": object()}, "ConfigError", "torch.autocast"),
        ({"forward_sync_buffers": False}, "ConfigError", "broadcast_buffers=False"),
        ({"no_such_option": 1}, "ConfigTypeError", "unexpected keyword argument 'no_such_option'"),
        ({"dim": "0"}, "ConfigTypeError", "dim must be an int"),
        ({"gradient_as_bucket_view": 1}, "ConfigTypeError", "gradient_as_bucket_view must be a bool"),
    ],
)
def test_torch_arguments_we_cannot_honour(kwargs, error, match):
    import nccl_ddp as nd
    from nccl_ddp import errors

    with pytest.raises(getattr(errors, error), match=match):
        nd.DistributedDataParallel(torch.nn.Linear(2, 2), **kwargs)


def test_positional_device_ids_gets_a_hint():
    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match="device_ids=\\[...\\] by keyword"):
        nd.DistributedDataParallel(torch.nn.Linear(2, 2), [0])


def test_torch_world_group_is_our_world_group(tmp_path):
    """torch's WORLD as process_group= (the default group of a torch script): our DDP joins our
    world beside torch's and reduces over it (more ranks and subgroups: test_torch_groups.py)."""
    import torch.distributed as dist

    import nccl_ddp as nd

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nd.DistributedDataParallel(torch.nn.Linear(2, 2), process_group=dist.group.WORLD)
        assert model.process_group is nd.get_world_group()
    finally:
        nd.destroy_process_group()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# torch.compile of the wrapper compiles the model, not our bookkeeping


def _compiled(rank: int, world: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import nccl_ddp as nd

    torch.set_num_threads(1)
    scenario = Scenario("cnn_class", steps=3, accumulate=2)
    nd.init_process_group("host")
    try:
        module = MODELS["cnn_class"](rank)
        ddp = nd.DistributedDataParallel(module)
        eager = train_scenario(ddp, module, rank, scenario)
        ddp.close()
        torch._dynamo.reset()
        counters.clear()
        module = MODELS["cnn_class"](rank)
        ddp = nd.DistributedDataParallel(module)
        aot_eager = torch._dynamo.lookup_backend("aot_eager")
        graphs = []

        def backend(gm, example_inputs):  # aot_eager, noting what each graph computes
            graphs.append(
                sorted(
                    {
                        str(n.target)
                        for n in gm.graph.nodes
                        if n.op == "call_module" or n.op == "call_function"
                    }
                )
            )
            return aot_eager(gm, example_inputs)

        compiled = train_scenario(torch.compile(ddp, backend=backend), module, rank, scenario)
        ddp.close()
        breaks = dict(counters["graph_break"])
    finally:
        nd.destroy_process_group()
    return {"eager": eager, "compiled": compiled, "breaks": breaks, "graphs": graphs}


@pytest.mark.slow
def test_torch_compile_matches_eager():
    for rank, r in enumerate(run_ranks(_compiled, WORLD, timeout=240)):
        # the only break is the one we ask for: dynamo skips the wrapper's forward frame (as it
        # does torch DDP's) and compiles the wrapped module's forward beneath it, one graph per
        # grad mode (training forwards, the no_grad evaluation forward); nothing of our
        # bookkeeping is traced (before: breaks on ndarray.flags and _ready.any())
        assert all("TorchDistributedDataParallel.forward" in reason for reason in r["breaks"]), list(
            r["breaks"]
        )
        assert 1 <= len(r["graphs"]) <= 2, r["graphs"]
        assert all(any("conv2d" in op for op in ops) for ops in r["graphs"]), r["graphs"]
        for key, value in r["eager"].items():
            np.testing.assert_allclose(
                r["compiled"][key], value, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {key}"
            )


def _built_config(group):
    import nccl_ddp as nd

    ddp = nd.DistributedDataParallel(
        torch.nn.Linear(2, 2),
        True,
        group,
        1.0,
        True,
        True,
        False,
        "PythonReducer",
        broadcast_buffers=False,
        check_finite="raise",
        dim=0,
    )
    return type(ddp).__name__, ddp.config


def test_core_options_pass_through_the_torch_wrapper():
    """The torch wrapper takes the core's options as the core does (positional or keyword) and
    names none of them itself: an option added to the core reaches torch users unchanged."""
    import inspect

    from fakegroup import run_threads

    from nccl_ddp.adapters.torch.ddp import TorchDistributedDataParallel
    from nccl_ddp.ddp.config import DDPConfig
    from nccl_ddp.ddp.data_parallel import DistributedDataParallel

    ((cls, config),) = run_threads(_built_config, 1)
    assert cls == "TorchDistributedDataParallel"
    assert config == DDPConfig(
        init_sync=True,
        bucket_cap_mb=1.0,
        find_unused_parameters=True,
        average_in_collective=True,
        static_graph=False,
        reducer_mode="PythonReducer",
        broadcast_buffers=False,
        check_finite="raise",
    )
    core = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    torch_own = set(inspect.signature(TorchDistributedDataParallel.__init__).parameters)
    assert core & torch_own == set()
