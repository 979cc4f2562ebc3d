"""What each worker starts with: its environment (torchrun's, Horovod's, our store's) and its
command line (python -u script, -m module, runpy.run_path, or the program itself)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

from nccl_ddp.errors import ConfigError
from nccl_ddp.launch.config import LaunchConfig

RUN_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def worker_env(
    config: LaunchConfig,
    nproc: int,
    node_rank: int,
    local_rank: int,
    port: int,
    secret: str,
    store_port: int,
    restart: int = 0,
    job_id: str = "",
    error_file: Optional[str] = None,
    torch_error_file: Optional[str] = None,
) -> dict:
    """The launcher's environment plus torchrun's variables and the store's address and secret.
    MASTER_PORT is not ours: the script may bind it (torch.distributed's env:// store does)."""
    env = dict(os.environ)
    rank, world = node_rank * nproc + local_rank, config.nnodes * nproc
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(config.nnodes),
            "ROLE_NAME": config.role,
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": config.master_addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": config.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0's torch store binds MASTER_PORT
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "NCCL_DDP_RESTART_COUNT": str(restart),
            "NCCL_DDP_SECRET": secret,
            "NCCL_DDP_STORE_HOSTED": "1",
            "NCCL_DDP_STORE_PORT": str(store_port),
            "NCCL_DDP_JOB_ID": job_id,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    if config.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = _own_gpu(local_rank)
    # Horovod's names for the same ranks, there before hvd.init() as Horovod's launcher sets them
    # (cross: this rank's node among the nodes, every node running nproc workers)
    env.update(
        {
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(world),
            "HOROVOD_LOCAL_RANK": env["LOCAL_RANK"],
            "HOROVOD_LOCAL_SIZE": str(nproc),
            "HOROVOD_CROSS_RANK": str(node_rank),
            "HOROVOD_CROSS_SIZE": str(config.nnodes),
        }
    )
    if error_file:
        env["NCCL_DDP_ERROR_FILE"] = error_file
    env["TORCHELASTIC_ERROR_FILE"] = torch_error_file or ""
    return env


def _own_gpu(local_rank: int) -> str:
    """--virtual-local-rank: the worker's one GPU, through the launcher's CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank)
    gpus = [g.strip() for g in visible.split(",")]
    if local_rank >= len(gpus):
        raise ConfigError(
            f"--virtual-local-rank: local rank {local_rank} has no GPU in "
            f"CUDA_VISIBLE_DEVICES={visible}; lower --nproc-per-node"
        )
    return gpus[local_rank]


def worker_command(config: LaunchConfig) -> list:
    """What each worker runs: python -u script, -m module, runpy.run_path, or the program."""
    if config.no_python and not config.run_path:
        return [config.entrypoint, *config.args]
    python = [os.environ.get("PYTHON_EXEC", sys.executable), "-u"]
    if config.run_path:
        return python + ["-c", RUN_PATH, config.entrypoint, *config.args]
    return python + (["-m"] if config.module else []) + [config.entrypoint, *config.args]


def check_entrypoint(config: LaunchConfig) -> None:
    """The script, module or program exists before any worker starts (ConfigError naming it)."""
    if config.module:
        return
    if config.no_python and not config.run_path:
        if shutil.which(config.entrypoint) is None:
            raise ConfigError(
                f"--no-python: program {config.entrypoint!r} not found or not executable; pass its path"
            )
    elif not os.path.exists(config.entrypoint):
        raise ConfigError(
            f"script {config.entrypoint!r} not found (working directory "
            f"{os.getcwd()}); pass the path of the training script, or -m module"
        )
