"""nccl-ddp-run: start one worker process per GPU (or per host slot) and watch them fail fast.

    nccl-ddp-run [--nproc-per-node N|auto] [--nnodes N --node-rank R --master-addr A
                 --master-port P [--store-port S]] [--standalone] [--max-restarts N]
                 [--log-dir DIR] [-m] script.py ...

torchrun's spellings work too (`--nproc_per_node`, `--rdzv-endpoint host:port`, ...; see cli.py).
Workers get the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT) plus NCCL_DDP_SECRET, NCCL_DDP_STORE_PORT and
NCCL_DDP_STORE_HOSTED=1: node 0's launcher hosts the job's store on the store port, so every
worker is a store client, and MASTER_PORT stays free for the script's own use (torch.distributed's
env:// store binds it). Output lines are prefixed with `[rank R] `. The first worker to fail stops
the others (SIGTERM, then SIGKILL after a grace period); the launcher then names the root cause
(from the workers' failure records) and exits with its code, or restarts every worker
(--max-restarts). Whatever happens, the job's /dev/shm segments are removed, and a watchdog
(reaper.py) kills the workers if the launcher itself is killed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import IO, Optional

from nccl_ddp.errors import ConfigError
from nccl_ddp.launch.cli import main, parse_args
from nccl_ddp.launch.config import LaunchConfig, local_device_count, resolve_nproc
from nccl_ddp.launch.reaper import Reaper, remove_segments
from nccl_ddp.launch.supervisor import Outcome, Signals, Worker, report, supervise
from nccl_ddp.store.client import StoreServer

__all__ = ["LaunchConfig", "launch", "main", "parse_args", "local_device_count", "resolve_nproc",
           "worker_env"]

log = logging.getLogger("nccl_ddp.launch")


def worker_env(config: LaunchConfig, nproc: int, local_rank: int, port: int, secret: str,
               store_port: int, restart: int = 0, job_id: str = "",
               error_file: Optional[str] = None) -> dict:
    """The launcher's environment plus the torchrun variables and the store's address and secret.
    MASTER_PORT is not ours: the script may bind it (torch.distributed's env:// store does)."""
    env = dict(os.environ)
    env.update({
        "RANK": str(config.node_rank * nproc + local_rank),
        "WORLD_SIZE": str(config.nnodes * nproc),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(config.node_rank),
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "NCCL_DDP_RESTART_COUNT": str(restart),
        "NCCL_DDP_SECRET": secret,
        "NCCL_DDP_STORE_HOSTED": "1",
        "NCCL_DDP_STORE_PORT": str(store_port),
        "NCCL_DDP_JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
    })
    if config.run_id:
        env["TORCHELASTIC_RUN_ID"] = config.run_id
    if error_file:
        env["NCCL_DDP_ERROR_FILE"] = error_file
    return env


def free_port(addr: str) -> int:
    """A port that is free on `addr` now (the script binds it later, as torchrun does)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def attempt_secret(secret: str, restart: int) -> str:
    """The store secret of one attempt: a worker left over from an earlier attempt (on any node)
    cannot join the new store generation."""
    if restart == 0:
        return secret
    return hashlib.sha256(f"{secret}/restart/{restart}".encode()).hexdigest()


def launch(config: LaunchConfig) -> int:
    """Run the job described by `config` on this node; returns the exit code for the launcher."""
    if not config.module and not os.path.exists(config.entrypoint):
        raise ConfigError(f"script {config.entrypoint!r} not found (working directory "
                          f"{os.getcwd()}); pass the path of the training script, or -m module")
    nproc = resolve_nproc(config.nproc_per_node)
    secret = config.secret or secrets.token_hex(32)
    port = config.master_port or free_port(config.master_addr)
    job_id = secrets.token_hex(6)          # this launcher's /dev/shm names: nccl_ddp-<job>-*
    shm_prefix = f"nccl_ddp-{job_id}-"
    records = tempfile.mkdtemp(prefix="nccl-ddp-run-")
    reaper = Reaper(os.getpid())
    reaper.watch_shm(shm_prefix)
    logs: list[Optional[IO[bytes]]] = [None] * nproc
    try:
        if config.log_dir:
            try:
                os.makedirs(config.log_dir, exist_ok=True)
                logs = [open(os.path.join(config.log_dir, f"rank_{config.node_rank * nproc + i}"
                                          f".log"), "wb") for i in range(nproc)]
            except OSError as e:
                raise ConfigError(f"--log-dir={config.log_dir}: cannot write the rank logs there "
                                  f"({e}); pass a writable directory") from e
        restart = 0
        while True:
            outcome = _attempt(config, nproc, port, attempt_secret(secret, restart), restart,
                               job_id, records, logs, reaper)
            remove_segments(shm_prefix)
            report(outcome)
            if outcome.code == 0:
                log.info("all %d worker(s) finished", nproc)
                return 0
            if outcome.signal is not None or restart >= config.max_restarts:
                return outcome.code
            restart += 1
            why = outcome.root.describe() if outcome.root else f"exit code {outcome.code}"
            log.warning("restart %d of %d: %s; restarting all %d worker(s)", restart,
                        config.max_restarts, why, nproc)
    finally:
        for f in logs:
            if f is not None:
                f.close()
        remove_segments(shm_prefix)
        shutil.rmtree(records, ignore_errors=True)
        reaper.close()


def _attempt(config: LaunchConfig, nproc: int, port: int, secret: str, restart: int, job_id: str,
             records: str, logs: list, reaper: Reaper) -> Outcome:
    """One generation of workers with a fresh store (node 0): start, supervise, clean up."""
    server = None
    store_port = config.store_port or (port + 1 if config.nnodes > 1 else 0)
    if config.node_rank == 0:
        server = StoreServer(config.master_addr, store_port, secret)
        store_port = server.port
    cmd = [sys.executable, "-u"] + (["-m"] if config.module else []) + [config.entrypoint]
    cmd += list(config.args)
    log.info("starting %d worker(s) on node %d/%d, store at %s:%d, MASTER_PORT %d%s: %s", nproc,
             config.node_rank, config.nnodes, config.master_addr, store_port, port,
             f", restart {restart}" if restart else "", " ".join(cmd[2:]))
    workers = []
    for i in range(nproc):
        rank = config.node_rank * nproc + i
        error_file = os.path.join(records, f"attempt{restart}_rank{rank}.json")
        workers.append(Worker(rank, i, error_file))
    out_lock = threading.Lock()
    try:
        with Signals() as sigs:
            try:
                for w, f in zip(workers, logs):
                    w.start(cmd, worker_env(config, nproc, w.local_rank, port, secret, store_port,
                                            restart, job_id, w.error_file), f, out_lock)
                    if w.proc is not None:
                        reaper.watch_group(w.proc.pid)
            except OSError as e:
                for w in workers:
                    if w.proc is not None:
                        w.signal(signal.SIGKILL)
                raise ConfigError(f"cannot start {cmd[2:]}: {e}") from e
            outcome = supervise(workers, sigs, config.grace_period)
        for w in workers:
            w.finish()
        return outcome
    finally:
        if server is not None:
            server.close()
