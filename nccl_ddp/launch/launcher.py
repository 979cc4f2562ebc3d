"""nccl-ddp-run: start one worker process per GPU (or `--nproc-per-node N`) and watch them fail fast.

    nccl-ddp-run [--nproc-per-node N|auto] [--nnodes N [--node-rank R] --master-addr A
                 --master-port P [--store-port S]] [--standalone] [--max-restarts N]
                 [--log-dir DIR] [-m] script.py ...     (and every torchrun flag: parser.py)

Workers get torchrun's environment (worker_start.py builds it, and their command) plus
NCCL_DDP_SECRET, NCCL_DDP_STORE_PORT and NCCL_DDP_STORE_HOSTED=1: node 0's launcher hosts the job's
store on the store port, so every worker is a store client, and MASTER_PORT stays free for the
script's own use (torch.distributed's env:// store binds it). Several nodes meet in that store
before each attempt (rendezvous.py). Output lines are prefixed with `[rank R] ` (logs.py routes
them). The first worker to fail stops the others (SIGTERM, then SIGKILL after a grace period); the
launcher then names the root cause (from the workers' failure records) and exits with its code, or
restarts every worker (--max-restarts). Whatever happens, the job's record folder is removed, and a
watchdog (reaper.py) kills the workers if the launcher itself is killed. docs/launch.md has the
details.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from typing import Optional

from nccl_ddp.errors import ConfigError, StoreError
from nccl_ddp.launch.config import LaunchConfig, local_device_count, resolve_nproc
from nccl_ddp.launch.logs import RunLogs, check_local_ranks
from nccl_ddp.launch.reaper import Reaper
from nccl_ddp.launch.rendezvous import (
    CLIENT_TIMEOUT,
    NodeRendezvous,
    Stopped,
    attempt_secret,
    connect,
)
from nccl_ddp.launch.supervisor import Outcome, Signals, Worker, report, supervise
from nccl_ddp.launch.worker_start import check_entrypoint, worker_command, worker_env
from nccl_ddp.store.client import StoreServer, TCPStore

__all__ = ["LaunchConfig", "launch", "local_device_count", "resolve_nproc", "worker_env"]

log = logging.getLogger("nccl_ddp.launch")


OMP_NOTICE = (
    "\n*****************************************\nSetting OMP_NUM_THREADS environment "
    "variable for each process to be 1 in default, to avoid your system being "
    "overloaded, please further tune the variable for optimal performance in your "
    "application as needed. \n*****************************************"
)


def free_port(addr: str) -> int:
    """A port that is free on `addr` now (the script binds it later, as torchrun does)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launch(config: LaunchConfig) -> int:
    """Run the job described by `config` on this node; returns the exit code for the launcher."""
    check_entrypoint(config)
    nproc = resolve_nproc(config.nproc_per_node)
    check_local_ranks(nproc, config.redirects, config.tee, config.local_ranks_filter)
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        log.warning("%s", OMP_NOTICE)
    with Signals(config.signals) as sigs:
        job = _Job(config, nproc, sigs)
        try:
            return job.run()
        finally:
            job.cleanup()


class _Job:
    """This node's part of the job: its attempts, what they share, and its cleanup."""

    def __init__(self, config: LaunchConfig, nproc: int, sigs: Signals):
        self.config, self.nproc, self.sigs = config, nproc, sigs
        self.secret = config.secret or secrets.token_hex(32)
        self.port = config.master_port or free_port(config.master_addr)
        self.store_port = config.store_port or (self.port + 1 if config.nnodes > 1 else 0)
        self.serving_port = self.store_port  # this attempt's (0 above: a free one each time)
        self.node_rank = config.node_rank
        self.job_id = secrets.token_hex(6)  # NCCL_DDP_JOB_ID: tells this launcher's jobs apart
        self.reaper = Reaper(os.getpid())
        self.records = tempfile.mkdtemp(prefix="nccl-ddp-run-")
        self.reaper.watch_dir(self.records)
        self.logs: Optional[RunLogs] = None

    def stopped(self) -> bool:
        return self.sigs.received is not None

    def _signalled(self) -> int:
        sig = int(self.sigs.received or signal.SIGTERM)
        log.warning("received %s; stopping", signal.Signals(sig).name)
        return 128 + sig

    def run(self) -> int:
        c = self.config
        self.logs = RunLogs(
            c.log_dir, c.run_id, c.redirects, c.tee, c.local_ranks_filter, c.duplicate_filters
        )
        restart = 0
        while True:
            if self.stopped():  # e.g. Ctrl-C between two attempts
                return self._signalled()
            try:
                outcome, restart, finished_elsewhere = self._attempt(restart)
            except Stopped:
                return self._signalled()
            report(outcome)
            if outcome.code == 0:
                log.info("all %d worker(s) finished", self.nproc)
                return 0
            if outcome.signal is not None or self.stopped():
                return outcome.code if outcome.signal is not None else self._signalled()
            if restart >= c.max_restarts:
                return outcome.code
            if finished_elsewhere:
                log.error("cannot restart: another node already finished its workers")
                return outcome.code
            restart += 1
            why = (
                outcome.root.describe() if outcome.root else outcome.elsewhere or f"exit code {outcome.code}"
            )
            log.warning(
                "restart %d of %d: %s; restarting all %d worker(s)", restart, c.max_restarts, why, self.nproc
            )

    def cleanup(self) -> None:
        """Runs whatever failed before: remove the records, stop the reaper."""
        shutil.rmtree(self.records, ignore_errors=True)
        self.reaper.close()

    def _host(self, secret: str, node_rank_known: bool) -> Optional[StoreServer]:
        """Node 0's store for one attempt; None if another launcher hosts it (c10d, unranked)."""
        c = self.config
        try:
            return StoreServer(c.master_addr, self.store_port, secret)
        except StoreError as e:
            if not node_rank_known and not c.is_host:
                return None  # another launcher on the endpoint's host, or not ours
            cause = e.__cause__ or e
            if c.store_port:
                what = f"--store-port {self.store_port} (NCCL_DDP_STORE_PORT)"
            elif c.nnodes > 1:
                what = f"port {self.store_port} (--master-port {self.port} + 1, where node 0 hosts the store)"
            else:
                what = f"port {self.store_port}"
            raise ConfigError(
                f"cannot host the job's store on {c.master_addr}:{self.store_port}"
                f": {what} is taken or {c.master_addr} is not an address of this "
                f"host ({cause}); pass a free --store-port"
            ) from e

    def _meet(self, restart: int) -> tuple:
        """Node 0's store for this attempt (hosted here or joined), and the rendezvous of the
        nodes: returns (server or None, rendezvous or None, attempt)."""
        c = self.config
        secret = attempt_secret(self.secret, restart)
        server = None
        if self.node_rank == 0 or (self.node_rank is None and c.is_host is not False):
            server = self._host(secret, self.node_rank is not None)
            if server is not None:
                self.node_rank = 0
        self.serving_port = server.port if server is not None else self.store_port
        if c.nnodes == 1:
            return server, None, restart
        try:
            if server is not None:
                store = TCPStore(c.master_addr, server.port, secret, timeout=CLIENT_TIMEOUT)
            else:
                store, restart = connect(
                    c.master_addr,
                    self.store_port,
                    self.secret,
                    restart,
                    c.max_restarts,
                    c.join_timeout,
                    self.stopped,
                )
            rdzv = NodeRendezvous(store, c.nnodes, restart)
            try:
                self.node_rank = rdzv.join(
                    self.node_rank, self.nproc, c.join_timeout, self.stopped, hosting=server is not None
                )
            except BaseException:
                rdzv.close()
                raise
        except BaseException:
            if server is not None:
                server.close()
            raise
        return server, rdzv, restart

    def _attempt(self, restart: int) -> tuple:
        """One generation of workers with a fresh store: meet, start, supervise, clean up.
        Returns (outcome, attempt number, whether another node already finished)."""
        server, rdzv, restart = self._meet(restart)
        try:
            try:
                outcome = self._run_workers(restart, rdzv)
            except BaseException:
                if rdzv is not None:
                    rdzv.fail(f"node {self.node_rank}: its launcher stopped")
                raise
            finished_elsewhere = False
            if server is not None and outcome.code == 0:
                _notice_unused(server)
            if rdzv is not None:
                if outcome.code == 0:
                    rdzv.finish(server is not None, self.stopped)
                elif outcome.elsewhere is None:
                    if outcome.signal is not None:
                        why = f"its launcher received {signal.Signals(outcome.signal).name}"
                    else:
                        why = outcome.root.describe() if outcome.root else f"exit code {outcome.code}"
                    rdzv.fail(f"node {self.node_rank}: {why}")
                    finished_elsewhere = rdzv.others_finished()
            return outcome, restart, finished_elsewhere
        finally:
            if rdzv is not None:
                rdzv.close()
            if server is not None:
                server.close()

    def _run_workers(self, restart: int, rdzv: Optional[NodeRendezvous]) -> Outcome:
        c, nproc = self.config, self.nproc
        assert self.node_rank is not None and self.logs is not None
        cmd = worker_command(c)
        log.info(
            "starting %d worker(s) on node %d/%d, store at %s:%d, MASTER_PORT %d%s: %s",
            nproc,
            self.node_rank,
            c.nnodes,
            c.master_addr,
            self.serving_port,
            self.port,
            f", restart {restart}" if restart else "",
            " ".join(cmd[2:] if cmd[1:2] == ["-u"] else cmd),
        )
        if self.stopped():
            raise Stopped
        secret = attempt_secret(self.secret, restart)
        logs = self.logs.attempt(restart, nproc)
        workers = []
        for lr, wl in zip(range(nproc), logs):
            rank = self.node_rank * nproc + lr
            record = os.path.join(self.records, f"attempt{restart}_rank{rank}")
            workers.append(Worker(rank, lr, record + ".json", wl.error_file or record + "_torch.json"))
        out_lock = threading.Lock()
        try:
            for w, wl in zip(workers, logs):
                env = worker_env(
                    c,
                    nproc,
                    self.node_rank,
                    w.local_rank,
                    self.port,
                    secret,
                    self.serving_port,
                    restart,
                    self.job_id,
                    w.error_file,
                    w.torch_error_file,
                )
                w.start(cmd, env, wl, out_lock, self.reaper.watch_group)
        except OSError as e:
            for w in workers:
                if w.proc is not None:
                    w.signal(signal.SIGKILL)
            for wl in logs:
                wl.close()
            self.logs.end_attempt()
            raise ConfigError(f"cannot start {cmd}: {e}") from e
        outcome = supervise(
            workers,
            self.sigs,
            c.grace_period,
            c.monitor_interval,
            rdzv.failed_elsewhere if rdzv is not None else lambda: None,
        )
        for w in workers:
            w.finish()
        self.logs.end_attempt()
        return outcome


def _notice_unused(server: StoreServer) -> None:
    """The job finished and no worker ever initialised nccl_ddp's process group: whatever reduced
    its gradients was not ours (a transformers Trainer, Lightning's "ddp" or a torch script keep
    torch's DDP unless switched). Say so once: launching with nccl-ddp-run alone changes nothing."""
    from nccl_ddp.comm.api import INIT_KEYS

    if server.has_prefix(INIT_KEYS):
        return
    log.warning(
        "no worker initialised nccl_ddp (nccl_ddp.init_process_group, or our DDP, Lightning "
        "strategy, Accelerator or transformers Trainer): the script's gradients were reduced by its "
        "own DDP, e.g. torch's. To use ours, switch one line: from nccl_ddp.transformers import "
        "Trainer; Trainer(strategy=nccl_ddp.lightning.NcclDDPStrategy()); from nccl_ddp.accelerate "
        "import Accelerator; or nccl_ddp.DistributedDataParallel (docs/torch.md)"
    )
