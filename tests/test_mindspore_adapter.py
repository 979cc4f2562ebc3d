"""The MindSpore adapter: the two examples from MindSpore's docs, run on CPU with 2 processes
through nccl-ddp-run, checked against single-process references (tests/ms_reference.py).

MindSpore 2.10 needs numpy<2, so everything MindSpore runs in the .venv-ms venv made by
scripts/setup_ms_venv.sh (or $NCCL_DDP_MS_VENV); without it these tests are skipped.
"""
from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("NCCL_DDP_MS_VENV", os.path.join(ROOT, ".venv-ms"))
PY = os.path.join(VENV, "bin", "python")
TIMEOUT = 150


def _venv_problem() -> str:
    if not os.path.exists(PY):
        return f"no MindSpore venv at {VENV}: run scripts/setup_ms_venv.sh"
    probe = subprocess.run([PY, "-c", "import mindspore, nccl_ddp"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return (f"the venv {VENV} cannot import mindspore and nccl_ddp "
                f"({probe.stderr.strip().splitlines()[-1:]}): run scripts/setup_ms_venv.sh")
    return ""


_problem = _venv_problem()
pytestmark = pytest.mark.skipif(bool(_problem), reason=_problem)


def _run(args: list, cwd: str) -> str:
    """Run `args` (python of the venv first) with a hard timeout; return stdout+stderr."""
    env = dict(os.environ, GLOG_v="3", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _launch(example: str, *args: str, cwd: str) -> str:
    return _run([PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2",
                 os.path.join(ROOT, "examples", example), *args], cwd)


def _reference(*args: str, cwd: str) -> None:
    _run([PY, os.path.join(ROOT, "tests", "ms_reference.py"), *args], cwd)


def _rank_lines(out: str, rank: int, pattern: str) -> list:
    return re.findall(rf"^\[rank {rank}\] {pattern}$", out, flags=re.M)


def test_ddp_example_matches_mean_of_rank_grads(tmp_path):
    """DDP (AVG in the collective, static graph, value_and_grad + hooks) over 4 AdamWeightDecay
    steps equals one process applying the mean of both ranks' grads."""
    ours, ref = tmp_path / "ours.npz", tmp_path / "ref.npz"
    out = _launch("ms_ddp_lenet.py", "--steps", "4", "--save", str(ours), cwd=str(tmp_path))
    _reference("ddp", str(ref), "--steps", "4", "--world", "2", cwd=str(tmp_path))
    for rank in (0, 1):
        assert len(_rank_lines(out, rank, r"epoch: 0, step: \d, loss is [0-9.]+")) == 4, out
    sums = [_rank_lines(out, r, r"param checksum: (\S+)") for r in (0, 1)]
    assert sums[0] and sums[0] == sums[1], out
    a, b = np.load(ours), np.load(ref)
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 8
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("scaled", [False, True], ids=["docs-inputs", "inputs-scaled-by-rank"])
def test_grad_reducer_example(tmp_path, scaled):
    """The TrainingWrapper prints the docs' 256.0 (rank r with scaled inputs: 256 (r+1)^2) and
    its Momentum step uses the sum of both ranks' grads."""
    flags = ["--scale-by-rank"] if scaled else []
    ours, ref = tmp_path / "ours.npz", tmp_path / "ref.npz"
    out = _launch("ms_grad_reducer.py", *flags, "--save", str(ours), cwd=str(tmp_path))
    _reference("grad-reducer", str(ref), "--world", "2", *flags, cwd=str(tmp_path))
    for rank in (0, 1):
        want = 256.0 * ((rank + 1) ** 2 if scaled else 1)
        assert _rank_lines(out, rank, re.escape(f"{want}")), out
    np.testing.assert_allclose(np.load(ours)["weight"], np.load(ref)["weight"], rtol=1e-6)


def test_ms_checks_in_venv(tmp_path):
    """Single-process behaviours (tests/ms_checks.py): graph-mode refusal, zero-copy out,
    accumulation until zero_grad."""
    out = _run([PY, os.path.join(ROOT, "tests", "ms_checks.py")], str(tmp_path))
    assert "ms_checks: all passed" in out, out

