"""The main job, examples/train_mlp.py, through the launcher: 2 host ranks, a few steps."""

import os
import subprocess
import sys

import pytest
from paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_mlp.py")


def _launch(*args, timeout=120):
    env = dict(os.environ, NCCL_DDP_NO_PROGRESS="1")
    return subprocess.run(
        [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", EXAMPLE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
def test_train_mlp_two_ranks_end_identical_and_loss_goes_down():
    r = _launch("--steps", "12")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 2 ranks hold identical parameters" in r.stdout
    assert "(first/last 2 steps: down)" in r.stdout
    steps = [line for line in r.stdout.splitlines() if "] step " in line]
    assert len(steps) == 12 and all(line.startswith("[rank 0]") for line in steps)
