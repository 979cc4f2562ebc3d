"""Ray Train (issue 28): TorchTrainer on a local Ray cluster with 2 CPU workers, in .venv-ray
(scripts/setup_ray_venv.sh; skipped without it). Ray initialises torch.distributed (gloo) in each
worker; `nd.init_process_group()` then joins beside it (rank 0's port and secret through
torch.distributed: no bind error on Ray's MASTER_PORT), and our DDP without an init of ours joins
by itself. Both train equal to torch DDP's run (1e-6), tests/support/ray_train_job.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from paths import ROOT

VENV = os.environ.get("NCCL_DDP_RAY_VENV", os.path.join(str(ROOT), ".venv-ray"))
PY = os.path.join(VENV, "bin", "python")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_train_torch_trainer_with_our_ddp_matches_torch_ddp(tmp_path):
    if not os.path.exists(PY):
        pytest.skip(f"no Ray venv at {VENV}: run scripts/setup_ray_venv.sh")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_DDP_SECRET"):
        env.pop(k, None)
    job = os.path.join(str(ROOT), "tests", "support", "ray_train_job.py")
    proc = subprocess.run([PY, job, str(tmp_path)], capture_output=True, text=True, timeout=800, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(diffs) == {f"{v} rank {r}" for v in ("ours", "ours-auto") for r in (0, 1)}
    assert max(diffs.values()) <= 1e-6, diffs
    assert "Address already in use" not in out and "has no secret" not in out
