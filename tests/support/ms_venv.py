"""The MindSpore venv (.venv-ms from scripts/setup_ms_venv.sh, or $NCCL_DDP_MS_VENV): its python
`PY`, `VENV_PROBLEM` (why it cannot be used; empty when it can: tests skip on it), and `run_ms` to
run a command with a hard timeout."""

from __future__ import annotations

import os
import subprocess

from paths import ROOT as REPO

ROOT = str(REPO)
VENV = os.environ.get("NCCL_DDP_MS_VENV", os.path.join(ROOT, ".venv-ms"))
PY = os.path.join(VENV, "bin", "python")
TIMEOUT = 150


def _venv_problem() -> str:
    if not os.path.exists(PY):
        return f"no MindSpore venv at {VENV}: run scripts/setup_ms_venv.sh"
    probe = subprocess.run(
        [PY, "-c", "import mindspore, nccl_ddp"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        return (
            f"the venv {VENV} cannot import mindspore and nccl_ddp "
            f"({probe.stderr.strip().splitlines()[-1:]}): run scripts/setup_ms_venv.sh"
        )
    return ""


VENV_PROBLEM = _venv_problem()


def run_ms(args: list, cwd: str) -> str:
    """Run `args` (python of the venv first) with a hard timeout; return stdout+stderr."""
    env = dict(os.environ, GLOG_v="3", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out
