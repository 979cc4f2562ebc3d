"""init_process_group under other launchers' environments (tests/test_env.py checks the parsing):
Lightning's (no RANK; rank 0's torch TCPStore holds MASTER_PORT), msrun's set by hand (its
scheduler process leaves at init), and a plain `python train.py`, which says once that it is a
job of one. The real msrun runs in tests/test_msrun.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from mp import run_ranks
from ports import free_port_beside

import nccl_ddp as nd
from nccl_ddp.comm import api
from nccl_ddp.job.launcher_env import WORLD_VARS as _WORLD_VARS

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MS_ROLE",
    "RANK_ID",
    "MS_SCHED_HOST",
    "MS_SCHED_PORT",
    "DEVICE_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
) + _WORLD_VARS


@pytest.fixture
def no_launcher(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(api, "_noticed_alone", False)
    yield monkeypatch
    nd.destroy_process_group()


def test_plain_python_says_once_that_it_is_a_job_of_one(no_launcher, caplog):
    with caplog.at_level(logging.INFO, logger="nccl_ddp.comm.api"):
        nd.init_process_group("host", timeout=10)
        nd.destroy_process_group()
        nd.init_process_group("host", timeout=10)
    notices = [r for r in caplog.records if "no launcher or scheduler variables" in r.message]
    assert len(notices) == 1 and notices[0].levelno == logging.WARNING
    assert "this job has one rank" in notices[0].message and "\n" not in notices[0].message


def test_explicit_job_of_one_gives_no_notice(no_launcher, caplog):
    with caplog.at_level(logging.INFO, logger="nccl_ddp.comm.api"):
        nd.init_process_group("host", timeout=10, rank=0, world_size=1)
    assert "no launcher" not in caplog.text


def test_msrun_scheduler_process_leaves_at_init(no_launcher):
    for k, v in {
        "MS_ROLE": "MS_SCHED",
        "RANK_ID": "0",
        "RANK_SIZE": "2",
        "MS_WORKER_NUM": "2",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": "8118",
    }.items():
        no_launcher.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        nd.init_process_group("host", timeout=10)
    assert exc.value.code == 0 and not nd.is_initialized()


def test_a_launcher_of_two_never_gives_a_job_of_one(no_launcher):
    no_launcher.setenv("MS_WORKER_NUM", "2")
    no_launcher.setenv("RANK_SIZE", "2")
    with pytest.raises(nd.errors.ConfigError, match="more than one process.*MS_WORKER_NUM=2"):
        nd.init_process_group("host", timeout=10)
    assert not nd.is_initialized()


def _lightning_rank(rank: int, world: int, msrun_port: int) -> tuple:
    """Lightning's launcher's variables: no RANK, LOCAL_WORLD_SIZE; torch's TCPStore first."""
    import os

    import torch.distributed as dist

    os.environ.pop("RANK")
    os.environ.pop("LOCAL_WORLD_SIZE")
    os.environ["NODE_RANK"] = "0"
    # Lightning's DDPStrategy: torch.distributed with env:// (rank 0 hosts MASTER_PORT)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    nd.init_process_group("host", timeout=30)
    try:
        x = np.full(3, rank + 1.0)
        nd.all_reduce(x)
        return nd.get_rank(), nd.get_world_size(), x.tolist()
    finally:
        nd.destroy_process_group()
        dist.destroy_process_group()


@pytest.mark.slow
def test_lightning_launcher_environment_joins_beside_torchs_store():
    """Before: each process was a job of one (no RANK) and both tried to host the store on
    MASTER_PORT, which torch's TCPStore holds ("Address already in use")."""
    pytest.importorskip("torch")
    results = run_ranks(_lightning_rank, 2, 0, timeout=120, env={"MASTER_PORT": str(free_port_beside(1))})
    assert results == [(0, 2, [3.0] * 3), (1, 2, [3.0] * 3)]


def _msrun_rank(rank: int, world: int, sched_port: int) -> tuple:
    """msrun 2.10's worker variables, by hand (no MASTER_*, no RANK)."""
    import os

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k)
    os.environ.update(
        {
            "MS_ROLE": "MS_WORKER",
            "RANK_ID": str(rank),
            "MS_NODE_ID": str(rank),
            "MS_WORKER_NUM": str(world),
            "RANK_SIZE": str(world),
            "DEVICE_ID": str(rank),
            "MS_SCHED_HOST": "127.0.0.1",
            "MS_SCHED_PORT": str(sched_port),
            "MS_TOPO_TIMEOUT": "600",
        }
    )
    nd.init_process_group("host", timeout=30)
    try:
        x = np.full(2, rank + 1.0)
        nd.all_reduce(x)
        return nd.get_rank(), nd.get_world_size(), nd.get_local_rank(), x.tolist()
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_msrun_environment_by_hand_joins_one_job():
    """Before: each worker reported rank 0 of 1 and an all-reduce of ones returned ones."""
    import socket

    with socket.socket() as sched:  # msrun's scheduler holds MS_SCHED_PORT
        sched.bind(("127.0.0.1", free_port_beside(-1)))
        sched.listen()
        results = run_ranks(_msrun_rank, 2, sched.getsockname()[1], timeout=60)
    assert results == [(0, 2, 0, [3.0, 3.0]), (1, 2, 1, [3.0, 3.0])]
