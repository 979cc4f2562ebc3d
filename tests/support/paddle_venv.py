"""The Paddle venv (.venv-paddle from scripts/setup_paddle_venv.sh, or $NCCL_DDP_PADDLE_VENV;
tinygrad is installed there too): its python `PY`, `missing(package)` (not installed there: the
tests skip), and `run` to run a command in it with a hard timeout, outside any launcher's ranks.
Paddle never runs in the test process itself (nor beside TensorFlow: importing both segfaults)."""

from __future__ import annotations

import glob
import os
import subprocess

from paths import ROOT as REPO

ROOT = str(REPO)
VENV = os.environ.get("NCCL_DDP_PADDLE_VENV", os.path.join(ROOT, ".venv-paddle"))
PY = os.path.join(VENV, "bin", "python")


def missing(package: str) -> bool:
    return not glob.glob(os.path.join(VENV, "lib", "python*", "site-packages", package, "__init__.py"))


def run(args: list, cwd, timeout: float, **extra_env: str) -> str:
    """Run `args` (python of the venv first) with the repository on PYTHONPATH and no inherited
    rank variables; return stdout+stderr, asserting it exited 0."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, **extra_env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(args, cwd=str(cwd), capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out
