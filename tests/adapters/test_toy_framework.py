"""A framework nccl_ddp has never heard of, added as docs/architecture.md's "adding a framework"
says a third party does: toyfw (tests/support/toyfw/, NumPy inside, its own tensor and model
classes) gets an adapter in a package of its own (tests/support/toyfw_nccl/: `adapter.py`
implementing `FrameworkAdapter`, registered with `nccl_ddp.frameworks.register`), and no file of
nccl_ddp changes. On 2 ranks of the host backend its models train in `DistributedDataParallel`
and its parameters' grads go through `DistributedGradReducer`: the grads are the mean over the
ranks, whichever way the step ends (the last grad, or the end-of-backward callback's `finalize()`
with a parameter one rank did not use)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from mp import run_ranks
from paths import ROOT

from nccl_ddp import frameworks
from nccl_ddp.errors import ConfigError, ConfigTypeError

STEPS = 2


def _data(rank, step):
    rng = np.random.default_rng(100 * step + rank)
    return rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)


def _grads(model):
    return {n: None if p.grad is None else p.grad.numpy().copy() for n, p in model.named_parameters()}


def _train(rank, world, unused_on_rank1):
    import toyfw
    import toyfw_nccl

    import nccl_ddp as nd

    toyfw_nccl.register()
    nd.init_process_group("host", timeout=60.0)
    try:
        model = toyfw.Linear(4, 3, seed=rank)  # rank 0's parameters win at construction
        ddp = nd.DistributedDataParallel(model, find_unused_parameters=unused_on_rank1)
        assert type(ddp) is nd.DistributedDataParallel  # toyfw has no wrapper class of its own
        alone = toyfw.Linear(4, 3)  # the same model without DDP: this rank's local grads
        for (_, a), p in zip(alone.named_parameters(), model.parameters()):
            np.copyto(a.numpy(), p.numpy())
        use_scale = not (unused_on_rank1 and rank == 1)
        local, reduced = [], []
        for step in range(STEPS):
            x, t = _data(rank, step)
            toyfw.mse(ddp(toyfw.Tensor(x), use_scale=use_scale), t).backward()
            toyfw.mse(alone(toyfw.Tensor(x), use_scale=use_scale), t).backward()
            reduced.append(_grads(model))
            local.append(_grads(alone))
            model.zero_grad()
            alone.zero_grad()
        steps = ddp.reducer.steps
        ddp.close()
        # DistributedGradReducer over toyfw parameters: toyfw tensors in, toyfw tensors out
        grads = [toyfw.Tensor(np.full(p.shape, rank + 1.0, np.float32)) for p in model.parameters()]
        out = nd.DistributedGradReducer(model.parameters())(grads)
        return {
            "steps": steps,
            "local": local,
            "reduced": reduced,
            "grad_reducer": [(type(g).__module__, g.numpy().copy()) for g in out],
        }
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("unused_on_rank1", [False, True], ids=["all-used", "scale-unused-on-rank1"])
def test_toy_framework_trains_with_the_mean_of_the_ranks_grads(unused_on_rank1):
    results = run_ranks(_train, 2, unused_on_rank1, timeout=120)
    for rank, res in enumerate(results):
        assert res["steps"] == STEPS
        for step in range(STEPS):
            got = res["reduced"][step]
            for name in got:
                contributions = [r["local"][step][name] for r in results]
                zeros = np.zeros_like(next(c for c in contributions if c is not None))
                want = np.mean([zeros if c is None else c for c in contributions], axis=0)
                assert got[name] is not None, f"rank {rank} step {step}: {name} got no grad"
                np.testing.assert_allclose(
                    got[name], want, rtol=1e-6, atol=1e-6, err_msg=f"{name} step {step}"
                )
        if unused_on_rank1:  # the mean takes rank 1's zeros: half of rank 0's grad
            assert results[1]["local"][0]["scale"] is None
        for module, g in res["grad_reducer"]:
            assert module == "toyfw"
            np.testing.assert_array_equal(g, np.full(g.shape, 1.5, np.float32))  # mean of 1 and 2


@pytest.mark.slow
def test_the_toy_adapter_meets_the_contract_for_mypy(tmp_path):
    """The adapter's `_contract: FrameworkAdapter = <module>` makes mypy check every member, in
    the third party's package as in ours: the adapter passes, a copy without `from_native`
    fails naming it."""
    support = os.path.join(ROOT, "tests", "support")
    text = open(os.path.join(support, "toyfw_nccl", "adapter.py")).read()
    broken = tmp_path / "brokenfw_nccl"
    broken.mkdir()
    (broken / "__init__.py").write_text("")
    renames = [("\ndef from_native(", "\ndef _from_native("), ("from_native(native)", "_from_native(native)")]
    renames += [
        ("[from_native(r)", "[_from_native(r)"),
        ("from toyfw_nccl import", "from brokenfw_nccl import"),
    ]
    for old, new in renames:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (broken / "adapter.py").write_text(text)
    cmd = [sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml")]
    cmd += ["--follow-imports=silent", "--cache-dir", str(tmp_path / "cache")]
    cmd += [os.path.join(support, "toyfw_nccl", "adapter.py"), str(broken / "adapter.py")]
    env = {**os.environ, "MYPYPATH": os.pathsep.join([support, str(tmp_path), str(ROOT)])}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path).stdout
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("brokenfw_nccl"), out
    assert '"FrameworkAdapter"' in errors[0] and "    from_native" in out, out


def test_register_refuses_what_it_cannot_serve():
    row = frameworks.Framework("torch2", "adapter", package="someone_else")
    with pytest.raises(ConfigError, match="'torch'.*torch adapter's"):
        frameworks.register("torch", row)
    with pytest.raises(ConfigError, match="numpy"):
        frameworks.register("numpy", row)
    with pytest.raises(ConfigError, match="pass package="):
        frameworks.register("toyfw2", frameworks.Framework("toyfw2", "adapter"))
    with pytest.raises(ConfigTypeError, match="Framework"):
        frameworks.register("toyfw2", ("toyfw2", "adapter"))
    assert "toyfw2" not in frameworks.ADAPTERS and "torch2" not in frameworks.ADAPTERS
