"""nccl-ddp-run: start one worker process per GPU (or per host slot) and watch them fail fast.

    nccl-ddp-run [--nproc-per-node N|auto] [--nnodes N --node-rank R --master-addr A
                 --master-port P [--store-port S]] [--standalone] [--log-dir DIR] [-m] script.py ...

Workers get the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus NCCL_DDP_SECRET, NCCL_DDP_STORE_PORT and NCCL_DDP_STORE_HOSTED=1: node 0's
launcher hosts the job's store on the store port, so every worker is a store client, and
MASTER_PORT stays free for the script's own use (torch.distributed's env:// store binds it). Output lines are prefixed with `[rank R] `. The first
worker to fail stops the others (SIGTERM, then SIGKILL after a grace period) and its exit code
becomes the launcher's.
"""
from __future__ import annotations

import argparse
import enum
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Optional, Sequence

from nccl_ddp.env import LOOPBACK
from nccl_ddp.errors import ConfigError, NcclDdpError
from nccl_ddp.store.client import StoreServer

log = logging.getLogger(__name__)

HOST_FALLBACK_NPROC = 2     # `auto` without a GPU: enough ranks to exercise the collectives
POLL_INTERVAL = 0.05


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `launch` needs; validated once here, never changed afterwards."""

    entrypoint: str                        # script path, or module name with module=True
    args: Sequence[str] = ()               # passed to the entrypoint unchanged
    module: bool = False                   # run `python -m entrypoint`
    nproc_per_node: "int | str" = "auto"   # an int, or "auto": one per GPU (2 without a GPU)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK            # node 0's address; its launcher hosts the store there
    master_port: int = 0                   # MASTER_PORT for the script; 0: a free one (single node)
    store_port: int = 0                    # our store on node 0; 0: free (one node), else master+1
    standalone: bool = False               # single node, loopback, free port
    log_dir: Optional[str] = None          # also write rank_<R>.log files here
    grace_period: float = 5.0              # seconds between SIGTERM and SIGKILL when stopping
    secret: Optional[str] = field(default=None, repr=False)   # None: generated (single node)

    def __post_init__(self):
        if not self.entrypoint:
            raise ConfigError("nccl-ddp-run: no script given; usage: nccl-ddp-run [options] "
                              "script.py args...")
        if self.nproc_per_node != "auto" and (not isinstance(self.nproc_per_node, int)
                                              or self.nproc_per_node < 1):
            raise ConfigError(f"--nproc-per-node={self.nproc_per_node!r}: use a positive integer "
                              f"or 'auto' (or set NCCL_DDP_NPROC_PER_NODE)")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes={self.nnodes}: use a positive integer (1 for one node)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank={self.node_rank} with --nnodes={self.nnodes}: the node "
                              f"rank must be in [0, nnodes)")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port={self.master_port} is not a port (0..65535)")
        if not 0 <= self.store_port <= 65535:
            raise ConfigError(f"--store-port={self.store_port} is not a port (0..65535)")
        if self.grace_period < 0:
            raise ConfigError(f"--grace-period={self.grace_period} must be >= 0")
        if self.nnodes > 1:
            if self.standalone:
                raise ConfigError("--standalone runs a single node; drop it or --nnodes")
            if self.master_port == 0:
                raise ConfigError("a multi-node job needs --master-port (or MASTER_PORT), the same "
                                  "free port on every node")
            if self.master_addr in (LOOPBACK, "localhost"):
                raise ConfigError("a multi-node job needs --master-addr (or MASTER_ADDR): the "
                                  "address of node 0, the same on every node")
            if not self.secret:
                raise ConfigError("a multi-node job needs NCCL_DDP_SECRET set to the same value on "
                                  "every node (e.g. from `python -c 'import secrets; "
                                  "print(secrets.token_hex(32))'`)")


def local_device_count() -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES if set, else NVML's count (0 if none)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:       # no pynvml, no driver: no GPU as far as we can tell
        log.debug("NVML unavailable (%s)", e)
        return 0


def resolve_nproc(nproc_per_node: "int | str") -> int:
    if nproc_per_node != "auto":
        return int(nproc_per_node)
    gpus = local_device_count()
    if gpus == 0:
        log.info("no GPU found (nvidia-ml-py / driver); starting %d host processes",
                 HOST_FALLBACK_NPROC)
    return gpus or HOST_FALLBACK_NPROC


class WorkerState(str, enum.Enum):
    """Life of one worker process as the launcher sees it.

        INIT --start--> RUNNING --exit 0-----------------> SUCCEEDED
                           |----exit != 0 or signal----> FAILED
                           '--stop--> STOPPING --exit--> STOPPED

    STOPPED means the launcher stopped it (another rank failed or the launcher got a signal);
    its exit code does not count as a failure.
    """

    INIT = "INIT"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Worker:
    """One worker process in its own process group, with its output pumped through a prefix."""

    def __init__(self, rank: int, local_rank: int):
        self.rank, self.local_rank = rank, local_rank
        self.state = WorkerState.INIT
        self.returncode: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._pumps: list[threading.Thread] = []

    def start(self, cmd: list[str], env: dict, log_file: Optional[IO[bytes]],
              out_lock: threading.Lock) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)   # own group: grandchildren too
        prefix = f"[rank {self.rank}] ".encode()
        for pipe, sink in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(pipe, sink, prefix, log_file, out_lock),
                                 daemon=True, name=f"nccl-ddp-run-pump-{self.rank}")
            t.start()
            self._pumps.append(t)
        self.state = WorkerState.RUNNING

    def poll(self) -> bool:
        """Update the state from the process; True if the worker just finished."""
        if self.state not in (WorkerState.RUNNING, WorkerState.STOPPING):
            return False
        code = self.proc.poll()
        if code is None:
            return False
        self.returncode = code
        if self.state is WorkerState.STOPPING:
            self.state = WorkerState.STOPPED
        else:
            self.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
        return True

    def signal(self, sig: int, stopping: bool = True) -> None:
        """Send `sig` to the worker's whole process group."""
        if self.state is WorkerState.RUNNING and stopping:
            self.state = WorkerState.STOPPING
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass                   # the group is already gone

    def finish(self, timeout: float = 2.0) -> None:
        for t in self._pumps:
            t.join(timeout)


def _pump(pipe: IO[bytes], sink: IO, prefix: bytes, log_file: Optional[IO[bytes]],
          lock: threading.Lock) -> None:
    out = getattr(sink, "buffer", None)
    sink_ok = True
    for line in iter(pipe.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            if sink_ok:
                try:
                    if out is not None:
                        out.write(prefix + line)
                    else:
                        sink.write((prefix + line).decode(errors="replace"))
                    sink.flush()
                except (OSError, ValueError):   # our stdout went away: keep draining the worker
                    sink_ok = False
            if log_file is not None:
                log_file.write(line)
                log_file.flush()
    pipe.close()


def worker_env(config: LaunchConfig, nproc: int, local_rank: int, port: int, secret: str,
               store_port: int) -> dict:
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
        "NCCL_DDP_SECRET": secret,
        "NCCL_DDP_STORE_HOSTED": "1",
        "NCCL_DDP_STORE_PORT": str(store_port),
        "PYTHONUNBUFFERED": "1",
    })
    return env


class _Signals:
    """Records SIGINT/SIGTERM for the monitor loop while installed (main thread only)."""

    def __init__(self):
        self.received: Optional[int] = None      # the first signal
        self.count = 0                           # a second one skips the grace period
        self._old: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _supervise(workers: list[Worker], signals: _Signals, grace: float) -> int:
    """Wait for the workers; stop them all on the first failure or signal. Returns the exit code.

    Stopping: SIGTERM (or the signal the launcher got) to every worker's process group, SIGKILL
    after `grace` seconds or at once when a second signal arrives."""
    failed: Optional[Worker] = None
    stop_deadline: Optional[float] = None
    killed = False
    while True:
        for w in workers:
            if w.poll() and w.state is WorkerState.FAILED and failed is None:
                failed = w
        if stop_deadline is None and (failed is not None or signals.received is not None):
            if failed is not None:
                log.error("rank %d (local rank %d) failed first: %s; stopping the other workers",
                          failed.rank, failed.local_rank, describe_exit(failed.returncode))
                sig = signal.SIGTERM
            else:
                sig = signals.received
                log.warning("received %s; forwarding it to the workers",
                            signal.Signals(sig).name)
            for w in workers:
                w.signal(sig)
            stop_deadline = time.monotonic() + grace
        if all(w.state not in (WorkerState.RUNNING, WorkerState.STOPPING) for w in workers):
            break
        if (stop_deadline is not None and not killed
                and (time.monotonic() > stop_deadline or signals.count > 1)):
            for w in workers:
                if w.state is WorkerState.STOPPING:
                    w.signal(signal.SIGKILL)
            killed = True
        time.sleep(POLL_INTERVAL)
    if stop_deadline is not None:
        for w in workers:                      # grandchildren left in a stopped worker's group
            w.signal(signal.SIGKILL, stopping=False)
    if failed is not None:
        code = failed.returncode
        return code if code > 0 else 128 - code
    if signals.received is not None:
        return 128 + signals.received
    return 0


def free_port(addr: str) -> int:
    """A port that is free on `addr` now (the script binds it later, as torchrun does)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launch(config: LaunchConfig) -> int:
    """Run the job described by `config` on this node; returns the exit code for the launcher."""
    if not config.module and not os.path.exists(config.entrypoint):
        raise ConfigError(f"script {config.entrypoint!r} not found (working directory "
                          f"{os.getcwd()}); pass the path of the training script, or -m module")
    nproc = resolve_nproc(config.nproc_per_node)
    secret = config.secret or secrets.token_hex(32)
    server = None
    port = config.master_port or free_port(config.master_addr)
    store_port = config.store_port or (port + 1 if config.nnodes > 1 else 0)
    if config.node_rank == 0:
        server = StoreServer(config.master_addr, store_port, secret)
        store_port = server.port
    cmd = [sys.executable, "-u"] + (["-m"] if config.module else []) + [config.entrypoint]
    cmd += list(config.args)
    log.info("starting %d worker(s) on node %d/%d, store at %s:%d, MASTER_PORT %d: %s", nproc,
             config.node_rank, config.nnodes, config.master_addr, store_port, port,
             " ".join(cmd[2:]))
    workers = [Worker(config.node_rank * nproc + i, i) for i in range(nproc)]
    logs: list[Optional[IO[bytes]]] = [None] * nproc
    out_lock = threading.Lock()
    try:
        if config.log_dir:
            try:
                os.makedirs(config.log_dir, exist_ok=True)
                logs = [open(os.path.join(config.log_dir, f"rank_{w.rank}.log"), "wb")
                        for w in workers]
            except OSError as e:
                raise ConfigError(f"--log-dir={config.log_dir}: cannot write the rank logs there "
                                  f"({e}); pass a writable directory") from e
        with _Signals() as sigs:
            try:
                for w, f in zip(workers, logs):
                    w.start(cmd, worker_env(config, nproc, w.local_rank, port, secret, store_port), f,
                            out_lock)
            except OSError as e:
                for w in workers:
                    if w.proc is not None:
                        w.signal(signal.SIGKILL)
                raise ConfigError(f"cannot start {cmd[2:]}: {e}") from e
            code = _supervise(workers, sigs, config.grace_period)
        for w in workers:
            w.finish()
        if code == 0:
            log.info("all %d worker(s) finished", nproc)
        return code
    finally:
        for f in logs:
            if f is not None:
                f.close()
        if server is not None:
            server.close()


def _nproc(value: str) -> "int | str":
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an integer nor 'auto'") from None


def parse_args(argv: Optional[Sequence[str]] = None) -> LaunchConfig:
    p = argparse.ArgumentParser(
        prog="nccl-ddp-run", description="Start one nccl_ddp worker per GPU on this node.",
        epilog="Each option falls back to the environment variable shown in its help.")
    p.add_argument("--nproc-per-node", type=_nproc,
                   default=os.environ.get("NCCL_DDP_NPROC_PER_NODE", "auto"),
                   help="workers on this node: an integer or 'auto' (one per GPU, 2 without a "
                        "GPU) [NCCL_DDP_NPROC_PER_NODE]")
    p.add_argument("--nnodes", type=int, default=os.environ.get("NCCL_DDP_NNODES", 1),
                   help="number of nodes [NCCL_DDP_NNODES]")
    p.add_argument("--node-rank", type=int, default=os.environ.get("NCCL_DDP_NODE_RANK", 0),
                   help="this node's index, 0..nnodes-1 [NCCL_DDP_NODE_RANK]")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", LOOPBACK),
                   help="address of node 0, where the store runs [MASTER_ADDR]")
    p.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT", 0),
                   help="MASTER_PORT given to the workers (free for the script's own use, e.g. "
                        "torch.distributed); 0 picks a free one (single node) [MASTER_PORT]")
    p.add_argument("--store-port", type=int, default=os.environ.get("NCCL_DDP_STORE_PORT", 0),
                   help="port of our store on node 0; 0: a free one on one node, MASTER_PORT+1 "
                        "across nodes [NCCL_DDP_STORE_PORT]")
    p.add_argument("--standalone", action="store_true",
                   help="single node on loopback with a free port (ignores MASTER_ADDR/PORT)")
    p.add_argument("--log-dir", default=os.environ.get("NCCL_DDP_LOG_DIR"),
                   help="also write each rank's output to DIR/rank_<R>.log [NCCL_DDP_LOG_DIR]")
    p.add_argument("--grace-period", type=float,
                   default=os.environ.get("NCCL_DDP_GRACE_PERIOD", 5.0),
                   help="seconds between SIGTERM and SIGKILL when stopping workers "
                        "[NCCL_DDP_GRACE_PERIOD]")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the entrypoint as a module (python -m)")
    p.add_argument("entrypoint", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = p.parse_args(argv)
    addr, port, store_port = ((LOOPBACK, 0, 0) if a.standalone
                              else (a.master_addr, a.master_port, a.store_port))
    return LaunchConfig(entrypoint=a.entrypoint, args=tuple(a.args), module=a.module,
                        nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
                        master_addr=addr, master_port=port, store_port=store_port,
                        standalone=a.standalone,
                        log_dir=a.log_dir, grace_period=a.grace_period,
                        secret=os.environ.get("NCCL_DDP_SECRET") or None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("nccl-ddp-run: %(message)s"))
    logging.getLogger("nccl_ddp").addHandler(handler)
    logging.getLogger("nccl_ddp").setLevel(logging.INFO)
    try:
        code = launch(parse_args(argv))
    except NcclDdpError as e:
        log.error("%s", e)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
