"""PyTorch's own DDP tests, with our class in torch's place (issue 35).

The installed torch wheel's `DistributedTest._DistTestBase`
(torch/testing/_internal/distributed/distributed_test.py) is imported at run time by
tests/support/torch_suite.py and driven as pytorch's test/distributed/test_distributed_spawn.py
drives it (2 ranks, gloo, torch.distributed from a file:// init method, nothing of ours in the
environment), with our torch wrapper where the tests look up torch's DistributedDataParallel. No
torch code is copied here: only the names of the tests.

The selection: the tests of that class about DDP (`ddp` or `DistributedDataParallel` in the name)
that pass with torch's own DDP on a CPU-only machine with gloo (measured with
NCCL_DDP_TORCH_SUITE=torch, torch 2.13.0: the other DDP tests need CUDA devices, NCCL, or are
skipped on Linux by torch itself). Each must pass with ours, except those listed in `EXCLUDED`
with why. The CPU behaviours of pytorch's test/distributed/test_c10d_gloo.py
DistributedDataParallelTest (not in the wheel) have tests of ours: test_torch_c10d_gloo.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from paths import ROOT, SUPPORT

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

# what passes with torch's own DDP here (2 CPU ranks, gloo)
PASS_WITH_TORCH = (
    "test_DistributedDataParallelCPU",  # 5 steps against a local model, then torch.save/load
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",  # no parameter: RuntimeError
    "test_ddp_create_graph",  # backward(create_graph=True) six times
    "test_ddp_logging_data_cpu",
    "test_dump_DDP_relevant_env_vars",  # builds no DDP
)
EXCLUDED = {
    "test_ddp_logging_data_cpu": (
        "reads torch's C++ DDP logger: the private _set_ddp_runtime_logging_sample_rate and its "
        "fields (forward_compute_time, backward_comm_time, gloo_num_threads, bucket_sizes, "
        "master_port, ...); our _get_ddp_logging_data() has the keys Lightning reads"
    ),
}
RUN = [name for name in PASS_WITH_TORCH if name not in EXCLUDED]
TIMEOUT = 900.0  # seconds for the whole selection (each test is bounded by torch's own 300 s too)


def run_suite(names: list, who: str, tmp_path) -> dict:
    """{name: outcome} of torch's tests `names` with `who`'s DDP ("ours" or "torch")."""
    out = tmp_path / f"{who}.json"
    env = {**os.environ, "NCCL_DDP_TORCH_SUITE": who, "TEMP_DIR": str(tmp_path)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "NCCL_DDP_SECRET"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "torch_suite.py"), str(out), *names],
        env=env,
        start_new_session=True,  # its ranks are in its session: killed with it on a timeout
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torch's suite did not finish within {TIMEOUT:g}s; so far: {_read(out)}\n{log[-4000:]}")
    results = _read(out)
    assert set(results) == set(names), f"the suite stopped early (exit {proc.returncode}):\n{log[-4000:]}"
    return results


def _read(path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    return run_suite(RUN, "ours", tmp_path_factory.mktemp("torch-suite"))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)  # the first one runs the whole selection (the fixture)
@pytest.mark.parametrize("name", RUN)
def test_torchs_own_ddp_test_passes_with_ours(ours, name):
    assert ours[name] == "pass", ours[name]


def test_exclusions_are_torch_tests_that_pass_with_torch():
    assert set(EXCLUDED) <= set(PASS_WITH_TORCH)
    assert all(why for why in EXCLUDED.values())
