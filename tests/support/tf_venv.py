"""The TensorFlow venv (.venv-tf from scripts/setup_tf_venv.sh, or $NCCL_DDP_TF_VENV): its python
`PY`, `venv_problem()` (why it cannot be used; empty when it can: tests skip on it, asked once, as
importing TensorFlow takes seconds), `run_tf` to run a command in it with a hard timeout, and
`two_ranks` for a module fixture's one 2-rank job.
TensorFlow never runs in the test process itself (nor beside Paddle: importing both segfaults)."""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest
from paths import ROOT as REPO
from paths import SUPPORT

ROOT = str(REPO)
VENV = os.environ.get("NCCL_DDP_TF_VENV", os.path.join(ROOT, ".venv-tf"))
PY = os.path.join(VENV, "bin", "python")
TIMEOUT = 240


@functools.cache
def venv_problem() -> str:
    if not os.path.exists(PY):
        return f"no TensorFlow venv at {VENV}: run scripts/setup_tf_venv.sh"
    probe = subprocess.run(
        [PY, "-c", "import tensorflow, keras, nccl_ddp"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    if probe.returncode != 0:
        return (
            f"the venv {VENV} cannot import tensorflow, keras and nccl_ddp "
            f"({probe.stderr.strip().splitlines()[-1:]}): run scripts/setup_tf_venv.sh"
        )
    return ""


def _env() -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_tf(args: list, cwd: str) -> str:
    """Run `args` (python of the venv first) with a hard timeout; return stdout+stderr."""
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def two_ranks(launcher: list, script: str, out, result: str) -> list:
    """[rank 0's results, rank 1's] of one 2-rank job: `launcher` (the venv's python and a
    launcher's arguments) runs tests/support/`script` with `out`, where rank r writes
    `{result}{r}.json`. Skips the test when the venv cannot be used."""
    problem = venv_problem()
    if problem:
        pytest.skip(problem)
    run_tf([*launcher, os.path.join(SUPPORT, script), str(out)], str(out))
    return [json.loads((out / f"{result}{r}.json").read_text()) for r in (0, 1)]
