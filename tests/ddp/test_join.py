"""Uneven inputs (`nccl_ddp.Join`): 3 ranks with 5 / 7 / 9 batches.

The oracle is torch DDP + torch.distributed.algorithms.Join on gloo, run in the same processes
on the same data: our final parameters must equal torch's to 1e-6 for both divide modes. The raw
array path and DistributedGradReducer are checked against sums computed here; a rank that raises
inside the block must make every other rank raise `JoinError` naming it, within a bound.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks
from torch_oracle import assert_matches_torch

WORLD = 3
BATCHES = (5, 7, 9)  # per rank: rank 2 is the last to join


# ---------------------------------------------------------------------------------------------
# torch oracle

CASES = {  # name -> (divide_by_initial_world_size, find_unused_parameters, extra DDP kwargs)
    "divide-initial": (True, False, {}),
    "divide-active": (False, False, {}),
    "divide-active-unused": (False, True, {}),
    "divide-initial-unused-pack": (True, True, {"reducer_mode": "PythonReducer"}),
    "divide-active-avg-in-collective": (False, False, {"average_in_collective": True}),
}


def _train_torch_join(ddp, module, rank: int, divide: bool, unused: bool, join) -> dict:
    import torch
    from torch_oracle import IN, OracleConfig, batches

    config = OracleConfig(steps=BATCHES[rank], batch=4)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    with join(ddp, divide):
        for k, (x, y) in enumerate(batches(rank, config)):
            assert x.shape[1] == IN
            out = ddp(x, use_branch=(not unused) or (k + rank) % 2 == 0)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
    return {n: t.detach().numpy().copy() for n, t in module.named_parameters()}


def _torch_join(ddp, divide):
    from torch.distributed.algorithms.join import Join

    return Join([ddp], divide_by_initial_world_size=divide)


def _our_join(ddp, divide):
    return ddp.join(divide_by_initial_world_size=divide)


def _torch_and_ours(rank: int, world: int, store_dir: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch_oracle import gloo_group, make_model

    import nccl_ddp as nd

    torch.set_num_threads(1)
    refs = {}
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        for name, (divide, unused, _) in CASES.items():
            module = make_model(rank)
            ddp = DistributedDataParallel(module, find_unused_parameters=unused)
            refs[name] = _train_torch_join(ddp, module, rank, divide, unused, _torch_join)
    out = {}
    nd.init_process_group("host")
    try:
        for name, (divide, unused, kwargs) in CASES.items():
            module = make_model(rank)
            ddp = nd.DistributedDataParallel(module, find_unused_parameters=unused, **kwargs)
            ours = _train_torch_join(ddp, module, rank, divide, unused, _our_join)
            ddp.close()
            out[name] = (refs[name], ours)
    finally:
        nd.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory):
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    return run_ranks(_torch_and_ours, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_join_matches_torch(name, torch_results):
    assert_matches_torch(torch_results, name)
    # every rank ends with the last joiner's parameters
    for key in torch_results[0][name][1]:
        np.testing.assert_array_equal(torch_results[0][name][1][key], torch_results[2][name][1][key])


@pytest.mark.slow
def test_divide_modes_differ(torch_results):
    """The two divide modes must give different numbers (else the test above proves little)."""
    a, b = torch_results[2]["divide-initial"][1], torch_results[2]["divide-active"][1]
    assert any(not np.allclose(a[k], b[k], rtol=1e-4) for k in a)


# ---------------------------------------------------------------------------------------------
# raw arrays and DistributedGradReducer, against sums computed here

SHAPES = [(3, 4), (5,), (2, 3)]


def _grad(rank: int, step: int, i: int) -> np.ndarray:
    g = np.random.default_rng(1000 * rank + 10 * step + i)
    return g.standard_normal(SHAPES[i]).astype(np.float32)


def _expected_sum(step: int, divide: bool, i: int) -> np.ndarray:
    active = [r for r in range(WORLD) if step < BATCHES[r]]
    total = sum(_grad(r, step, i).astype(np.float64) for r in active)
    return total / (WORLD if divide else len(active))


def _arrays_join(rank: int, world: int, divide: bool, mode: str) -> dict:
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host")
    try:
        params = [np.zeros(s, np.float32) for s in SHAPES]
        ddp = nd.DistributedDataParallel(ArrayModule(params), reducer_mode=mode, bucket_cap_mb=0)
        got = []
        with nd.Join([ddp], divide_by_initial_world_size=divide):
            for step in range(BATCHES[rank]):
                for i in reversed(range(len(SHAPES))):
                    ddp.mark_ready(i, _grad(rank, step, i))
                got.append([g.copy() for g in ddp.grads])
                for p, g in zip(params, ddp.grads):
                    p -= 0.1 * g
                ddp.zero_grad()
        ddp.close()
        return {"got": got, "params": [p.copy() for p in params]}
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("mode", ["CppReducer", "PythonReducer"])
def test_raw_arrays_join(divide, mode):
    results = run_ranks(_arrays_join, WORLD, divide, mode, timeout=90)
    for rank, res in enumerate(results):
        for step, grads in enumerate(res["got"]):
            for i, g in enumerate(grads):
                np.testing.assert_allclose(
                    g,
                    _expected_sum(step, divide, i),
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"rank {rank} step {step} grad {i}",
                )
    final = [sum(-0.1 * _expected_sum(s, divide, i) for s in range(max(BATCHES))) for i in range(len(SHAPES))]
    for res in results:  # the last joiner's parameters everywhere
        for i, p in enumerate(res["params"]):
            np.testing.assert_allclose(p, final[i], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(p, results[2]["params"][i])


def _grad_reducer_join(rank: int, world: int, divide: bool, compress) -> list:
    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        reducer = nd.DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], compress=compress)
        out = []
        with nd.Join([reducer], divide_by_initial_world_size=divide):
            for step in range(BATCHES[rank]):
                out.append([np.array(g) for g in reducer([_grad(rank, step, i) for i in range(len(SHAPES))])])
        reducer.close()
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("divide,compress", [(True, None), (False, None), (False, "bf16")])
def test_grad_reducer_join(divide, compress):
    results = run_ranks(_grad_reducer_join, WORLD, divide, compress, timeout=90)
    tol = 2e-2 if compress else 1e-5  # bf16 keeps 8 significant bits
    for rank, res in enumerate(results):
        assert len(res) == BATCHES[rank]
        for step, grads in enumerate(res):
            for i, g in enumerate(grads):
                np.testing.assert_allclose(
                    g,
                    _expected_sum(step, divide, i),
                    rtol=tol,
                    atol=tol,
                    err_msg=f"rank {rank} step {step} grad {i}",
                )


# ---------------------------------------------------------------------------------------------
# failures: a rank raising inside the block, throw_on_early_termination


class _Boom(RuntimeError):
    pass


def _raises_inside(rank: int, world: int, fail_rank: int, fail_step: int) -> None:
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=120.0)
    try:
        params = [np.zeros(s, np.float32) for s in SHAPES]
        ddp = nd.DistributedDataParallel(ArrayModule(params))
        with ddp.join():
            for step in range(BATCHES[rank]):
                if rank == fail_rank and step == fail_step:
                    raise _Boom(f"bad batch {step} on rank {rank}")
                for i in reversed(range(len(SHAPES))):
                    ddp.mark_ready(i, _grad(rank, step, i))
                ddp.zero_grad()
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank,fail_step", [(0, 3), (2, 7)])
def test_rank_raising_inside_join_stops_every_rank(fail_rank, fail_step):
    """Rank 0 fails while the others still train, rank 2 while the others have joined: every
    other rank raises JoinError naming it well before the 120 s collective timeout."""
    import time

    t0 = time.monotonic()
    failures = run_ranks(_raises_inside, WORLD, fail_rank, fail_step, timeout=60, expect_fail=True)
    assert time.monotonic() - t0 < 60
    assert sorted(failures) == list(range(WORLD)), failures
    assert "_Boom" in failures[fail_rank] and f"bad batch {fail_step}" in failures[fail_rank]
    for r in range(WORLD):
        if r != fail_rank:
            assert "JoinError" in failures[r], failures[r]
            assert f"rank {fail_rank} raised _Boom inside nccl_ddp.Join" in failures[r], failures[r]


def _throws_early(rank: int, world: int) -> str:
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import JoinError

    nd.init_process_group("host", timeout=60.0)
    try:
        params = [np.zeros(s, np.float32) for s in SHAPES]
        ddp = nd.DistributedDataParallel(ArrayModule(params))
        steps = 0
        try:
            with ddp.join(throw_on_early_termination=True):
                for step in range(BATCHES[rank]):
                    for i in reversed(range(len(SHAPES))):
                        ddp.mark_ready(i, _grad(rank, step, i))
                    steps += 1
                    ddp.zero_grad()
        except JoinError as e:
            return f"{steps}: {e}"
        return f"{steps}: no error"
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_throw_on_early_termination():
    out = run_ranks(_throws_early, WORLD, timeout=60)
    assert out[0].startswith("5: ") and "exhausted all inputs" in out[0], out
    for r in (1, 2):  # they had finished 5 steps when rank 0 ran out
        assert out[r].startswith("5: ") and "detected at least one rank" in out[r], out


def _disabled(rank: int, world: int) -> int:
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=60.0)
    try:
        params = [np.zeros(s, np.float32) for s in SHAPES]
        ddp = nd.DistributedDataParallel(ArrayModule(params))
        with ddp.join(enable=False):
            for step in range(5):
                for i in reversed(range(len(SHAPES))):
                    ddp.mark_ready(i, _grad(rank, step, i))
                ddp.zero_grad()
        return ddp.reducer.steps
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_enable_false_is_plain_ddp():
    assert run_ranks(_disabled, WORLD, timeout=60) == [5, 5, 5]


def test_join_bad_arguments():
    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match="joinables must be a non-empty list"):
        nd.Join([])
    with pytest.raises(ConfigTypeError, match=r"joinables\[0\] is a int"):
        nd.Join([3])


class _Counting:
    """A joinable of its own (no base class: `Joinable` is a protocol): counts its steps and the
    steps it shadowed after joining."""

    def __init__(self, group):
        from nccl_ddp.ddp.join import JoinState

        self.group, self.join_state = group, JoinState()
        self.steps, self.shadowed, self.finished, self.divide = 0, 0, None, None

    @property
    def join_process_group(self):
        return self.group

    def join_hook(self, **kwargs):
        from nccl_ddp.ddp.join import ShadowJoinHook

        hook = ShadowJoinHook(self, "_Counting", kwargs)
        self.divide = self.join_state.divide_by_initial
        return hook

    def step(self):
        from nccl_ddp import Join

        self.steps += 1
        return Join.notify_join_context(self)

    def join_shadow_step(self):
        self.shadowed += 1

    def join_finished(self, is_last_joiner):
        self.finished = is_last_joiner


def _own_joinable(group):
    import nccl_ddp as nd

    j = _Counting(group)
    active = []
    with nd.Join([j], divide_by_initial_world_size=False):
        for _ in range(group.rank + 1):
            active.append(j.step())
    return active, j.shadowed, j.finished, j.divide, j.join_state.config.enable


def test_a_joinable_of_ones_own_is_driven_by_the_shadow_hook():
    """Join drives any object with the protocol's public state (join_state) and methods; rank r
    steps r + 1 times, so a rank shadows the steps of the ranks with more."""
    from fakegroup import run_threads

    out = run_threads(_own_joinable, 3)
    assert [o[0] for o in out] == [[3], [3, 2], [3, 2, 1]]
    assert [o[1] for o in out] == [2, 1, 0]
    assert [o[2] for o in out] == [False, False, True]
    assert all(o[3] is False and o[4] is False for o in out)  # config reset on exit
