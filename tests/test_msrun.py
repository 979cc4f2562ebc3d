"""MindSpore's own launcher, msrun, starting the seed's DDP example (LeNet5,
average_in_collective=True, static_graph=True, value_and_grad, net.zero_grad()) with 2 workers on
this CPU machine: the workers join one job (before: each trained alone as rank 0 of 1) and end
where one process applying the mean of both ranks' grads ends. Once with the example as it is,
once after mindspore.communication.init() (tests/support/ms_after_init.py). msrun also runs the script
as its scheduler process: that one leaves at init (ours or MindSpore's).

Needs the MindSpore venv (scripts/setup_ms_venv.sh, or $NCCL_DDP_MS_VENV); skipped without it.
"""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
from paths import ROOT as REPO
from paths import SUPPORT
from ports import free_port_beside

ROOT = str(REPO)
VENV = os.environ.get("NCCL_DDP_MS_VENV", os.path.join(ROOT, ".venv-ms"))
PY, MSRUN = os.path.join(VENV, "bin", "python"), os.path.join(VENV, "bin", "msrun")
TIMEOUT = 200

pytestmark = [
    pytest.mark.skipif(not os.path.exists(MSRUN), reason=f"no msrun in {VENV}: run scripts/setup_ms_venv.sh"),
    pytest.mark.slow,
    pytest.mark.timeout(3 * TIMEOUT + 60),
]


def _env() -> dict:
    env = dict(
        os.environ,
        GLOG_v="3",
        PYTHONUNBUFFERED="1",
        PATH=os.path.join(VENV, "bin") + os.pathsep + os.environ.get("PATH", ""),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NCCL_DDP_SECRET",
        "NCCL_DDP_STORE_PORT",
    ):
        env.pop(k, None)
    return env


def _run(args: list, cwd) -> str:
    proc = subprocess.run(args, cwd=str(cwd), capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("msrun_reference")
    _run(
        [
            PY,
            os.path.join(SUPPORT, "ms_reference.py"),
            "ddp",
            str(out / "ddp.npz"),
            "--steps",
            "4",
            "--world",
            "2",
        ],
        out,
    )
    return np.load(out / "ddp.npz")


@pytest.mark.parametrize("after_ms_init", [False, True], ids=["alone", "after-ms-init"])
def test_msrun_two_workers_train_as_one_job(tmp_path, reference, after_ms_init):
    example = os.path.join(ROOT, "examples", "ms_ddp_lenet.py")
    script = [os.path.join(SUPPORT, "ms_after_init.py"), example] if after_ms_init else [example]
    logs = tmp_path / "logs"
    out = _run(
        [
            MSRUN,
            "--worker_num=2",
            "--local_worker_num=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port_beside(-1)}",
            "--join=True",
            f"--log_dir={logs}",
            *script,
            "--steps",
            "4",
            "--save",
            str(tmp_path / "ours.npz"),
        ],
        tmp_path,
    )
    workers = [(logs / f"worker_{r}.log").read_text() for r in (0, 1)]
    for log in workers:
        assert "deprecated" not in log, log[-3000:]
        assert len(re.findall(r"^epoch: 0, step: \d, loss is", log, re.M)) == 4, log[-3000:]
    sums = [re.findall(r"^param checksum: (\S+)$", log, re.M) for log in workers]
    assert sums[0] and sums[0] == sums[1], (sums, out[-2000:])
    if after_ms_init:
        assert all(f"mindspore rank {r} of 2" in workers[r] for r in (0, 1))
    ours = np.load(tmp_path / "ours.npz")
    assert sorted(ours.files) == sorted(reference.files)
    for k in ours.files:
        np.testing.assert_allclose(ours[k], reference[k], rtol=1e-5, atol=1e-6, err_msg=k)
