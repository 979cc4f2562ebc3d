"""overlap_param_gather without races (2 ranks, host backend, gloo for torch's side), each against
torch DDP + unsharded AdamW to 1e-6, the all-gathers held back on the comm stream after every
step so that they are still pending when the script goes on:
- `model.state_dict()` right after `step()` saves the stepped parameters (before: half-gathered);
- `model.load_state_dict()` right after `step()` is what trains on, on both ranks (before: partly
  overwritten by the older gather, and the ranks disagreed);
- `opt.wait_for_params()` then a direct read of the parameters;
- `parameters()` of our DDP wrapper right after `step()` (before: half-gathered values);
- a parent whose forward reads a child's weight without calling the child trains on the gathered
  values (before: on stale ones);
- the default stage (ZeRO-1) refuses overlap_param_gather with a ConfigError naming ZeroConfig(stage=2).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from zero_oracle import OPTIMIZERS, STEPS, global_batches, gloo_and_host, local, make_model  # noqa: E402

WORLD = 2
SMALL = 400 / (1 << 20)
LAG_S = 0.2  # the comm stream sleeps this long before each step's all-gathers
LOAD_AT = 4


def _parent_reads_child():
    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(7, 13)
            self.b = torch.nn.Linear(13, 3)

        def forward(self, x):  # reads a's weight directly: a's forward never runs
            return self.b(torch.tanh(torch.nn.functional.linear(x, self.a.weight, self.a.bias)))

    torch.manual_seed(5)
    return Parent()


def _snapshot(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def _loaded_state() -> dict:
    torch.manual_seed(99)
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}


def _train(make, rank: int, world: int, ours: bool, mode: str) -> list:
    """Per step what the mode reads right after step(): state_dict, or the parameters after
    wait_for_params; `load` also loads a fixed state right after step LOAD_AT."""
    import nccl_ddp as nd

    cls, kw = OPTIMIZERS["adamw"]
    m = make()
    if ours:
        zero = nd.ZeroConfig(stage=2, overlap_param_gather=True)
        wrapped = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=zero)
        opt = nd.ZeroRedundancyOptimizer(m.parameters(), getattr(torch.optim, cls), **kw)
    else:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        wrapped, opt = TorchDDP(m), getattr(torch.optim, cls)(m.parameters(), **kw)
    seen = []
    data = global_batches()
    for step in range(STEPS):
        x, y = local(data[step], rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        if ours:
            opt.shard_memory.comm.submit(time.sleep, LAG_S)  # the gathers start LAG_S after step() returns
        opt.step()
        if mode == "wait_for_params":
            if ours:
                opt.wait_for_params()
            seen.append({n: p.detach().clone().numpy() for n, p in m.named_parameters()})
        elif mode == "wrapper_parameters":  # through the DDP wrapper, in module order
            seen.append({str(i): p.detach().clone().numpy() for i, p in enumerate(wrapped.parameters())})
        else:
            if mode == "load" and step == LOAD_AT:
                m.load_state_dict(_loaded_state())
            seen.append(_snapshot(m))
    if ours:
        opt.wait_for_params()
        wrapped.close()
    return seen


def _run(rank: int, world: int, store_dir: str) -> dict:
    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    out: dict = {}
    with gloo_and_host(rank, world, store_dir):
        for name, make, mode in (
            ("state_dict", make_model, "state_dict"),
            ("load_state_dict", make_model, "load"),
            ("wait_for_params", make_model, "wait_for_params"),
            ("wrapper_parameters", make_model, "wrapper_parameters"),
            ("parent_reads_child", _parent_reads_child, "state_dict"),
        ):
            out[name] = (_train(make, rank, world, False, mode), _train(make, rank, world, True, mode))
        m = make_model()
        ddp = nd.DistributedDataParallel(m)
        try:
            nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, overlap_param_gather=True)
        except ConfigError as e:
            out["default_refuses"] = str(e)
        ddp.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["state_dict", "load_state_dict", "wait_for_params", "wrapper_parameters", "parent_reads_child"]
)
def test_overlapped_gather_is_never_read_or_written_half_done(results, case):
    for rank, res in enumerate(results):
        ref, ours = res[case]
        assert len(ours) == len(ref) == STEPS
        for step, (r, o) in enumerate(zip(ref, ours)):
            for key in r:
                np.testing.assert_allclose(
                    o[key], r[key], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {case} step {step}: {key}"
                )
    if case == "load_state_dict":  # the load took: the next step starts from the loaded state
        loaded = _loaded_state()
        after = results[0][case][1][LOAD_AT]
        assert all(np.array_equal(after[k], v.numpy()) for k, v in loaded.items())


@pytest.mark.slow
def test_default_stage_refuses_overlap_naming_zero2(results):
    for res in results:
        assert "overlap_param_gather=True needs ZeRO-2" in res["default_refuses"]
        assert "ZeroConfig(stage=2" in res["default_refuses"]
