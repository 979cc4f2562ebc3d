"""What one `nccl-ddp-run` invocation runs: the validated `LaunchConfig` and the worker count."""

from __future__ import annotations

import logging
import math
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from nccl_ddp.errors import ConfigError
from nccl_ddp.job.env import LOOPBACK

log = logging.getLogger("nccl_ddp.launch")

HOST_FALLBACK_NPROC = 2  # `auto` without a GPU: enough ranks to exercise the collectives
MAX_MONITOR_INTERVAL = 3600.0  # seconds; the launcher looks at least this often (and sleeps in slices)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `launch` needs; validated once here, never changed afterwards."""

    entrypoint: str  # script path, or module name with module=True
    args: Sequence[str] = ()  # passed to the entrypoint unchanged
    module: bool = False  # run `python -m entrypoint`
    nproc_per_node: int | str = "auto"  # an int, or "auto": one per GPU (2 without a GPU)
    nnodes: int = 1
    node_rank: Optional[int] = 0  # None: assigned at the rendezvous (c10d), first come
    master_addr: str = ""  # node 0's address, where its launcher hosts the store ("": 127.0.0.1, one node)
    master_port: int = 0  # MASTER_PORT for the script; 0: a free one (single node)
    store_port: int = 0  # our store on node 0; 0: free (one node), else master+1
    standalone: bool = False  # single node, loopback, free port
    log_dir: Optional[str] = None  # also write rank_<R>.log files here
    grace_period: float = 5.0  # seconds between SIGTERM and SIGKILL when stopping
    max_restarts: int = 0  # restart every worker after a failure, this many times
    run_id: str = "none"  # names the job (--rdzv-id): TORCHELASTIC_RUN_ID
    secret: Optional[str] = field(default=None, repr=False)  # None: generated (single node)
    rdzv_backend: str = "static"  # c10d: node ranks may come from the rendezvous
    join_timeout: float = 600.0  # seconds the nodes wait for each other (--rdzv-conf)
    is_host: Optional[bool] = None  # c10d: host the store here (None: endpoint is local)
    role: str = "default"  # ROLE_NAME
    monitor_interval: float = 0.1  # seconds between looks at the workers
    no_python: bool = False  # run the entrypoint itself, not `python entrypoint`
    run_path: bool = False  # runpy.run_path(entrypoint) in each worker
    redirects: Any = 0  # torchrun's Std: 0-3, or {local_rank: 0-3}
    tee: Any = 0
    local_ranks_filter: Optional[frozenset] = None  # console shows only these local ranks
    signals: tuple = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    virtual_local_rank: bool = False  # LOCAL_RANK=0, CUDA_VISIBLE_DEVICES one GPU each
    duplicate_filters: tuple = ((), ())  # stdout, stderr lines with these go to filtered_*.log

    def __post_init__(self) -> None:
        if not self.master_addr and self.nnodes == 1:
            object.__setattr__(self, "master_addr", LOOPBACK)  # the one node's own address
        if not self.entrypoint:
            raise ConfigError(
                "nccl-ddp-run: no script given; usage: nccl-ddp-run [options] script.py args..."
            )
        self._check_topology()
        self._check_timing()
        self._check_how_to_run()
        if self.nnodes > 1:
            self._check_multi_node()

    def _check_topology(self) -> None:
        """Workers per node, nodes, this node's rank and the two ports."""
        if self.nproc_per_node != "auto" and (
            not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1
        ):
            raise ConfigError(
                f"--nproc-per-node={self.nproc_per_node!r}: use a positive integer "
                f"or 'auto' (or set NCCL_DDP_NPROC_PER_NODE)"
            )
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes={self.nnodes}: use a positive integer (1 for one node)")
        if self.node_rank is None and self.rdzv_backend != "c10d":
            raise ConfigError(
                "no node rank: pass --node-rank, or --rdzv-backend c10d to have "
                "the rendezvous assign node ranks"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank={self.node_rank} with --nnodes={self.nnodes}: the node "
                f"rank must be in [0, nnodes)"
            )
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port={self.master_port} is not a port (0..65535)")
        if not 0 <= self.store_port <= 65535:
            raise ConfigError(f"--store-port={self.store_port} is not a port (0..65535)")

    def _check_timing(self) -> None:
        """Every wait finite and positive; restarts not negative."""
        for flag, seconds in (
            ("--grace-period", self.grace_period),
            ("--monitor-interval", self.monitor_interval),
            ("--rdzv-conf join_timeout", self.join_timeout),
        ):
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds)
            ):
                raise ConfigError(
                    f"{flag}={seconds!r}: use a finite number of seconds (NaN and infinity would "
                    "leave a wait unbounded)"
                )
        if self.grace_period < 0:
            raise ConfigError(f"--grace-period={self.grace_period} must be >= 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts} must be >= 0 (0: no restart)")
        if not 0 < self.monitor_interval <= MAX_MONITOR_INTERVAL:
            raise ConfigError(
                f"--monitor-interval={self.monitor_interval}: use seconds > 0 and at most "
                f"{MAX_MONITOR_INTERVAL:g} (torchrun's default is 0.1)"
            )
        if not self.join_timeout > 0:
            raise ConfigError(f"--rdzv-conf join_timeout={self.join_timeout} must be > 0 seconds")

    def _check_how_to_run(self) -> None:
        """-m, --no-python and --run-path: one way to start the entrypoint."""
        if self.module and (self.no_python or self.run_path):
            raise ConfigError(
                "-m/--module runs a module with python: drop it, or drop --no-python/--run-path"
            )
        if self.run_path and not os.path.isabs(self.entrypoint):
            raise ConfigError(
                f"--run-path needs the script's absolute path (as torchrun), got {self.entrypoint!r}"
            )

    def _check_multi_node(self) -> None:
        """What a job across nodes needs: not --standalone, node 0's address and port, one secret."""
        if self.standalone:
            raise ConfigError("--standalone runs a single node; drop it or --nnodes")
        if self.master_port == 0:
            raise ConfigError(
                "a multi-node job needs --master-port (or MASTER_PORT), the same free port on every node"
            )
        if not self.master_addr:
            raise ConfigError(
                "a multi-node job needs --master-addr (or MASTER_ADDR): the "
                "address of node 0, the same on every node (127.0.0.1 for nodes on this machine)"
            )
        if not self.secret:
            raise ConfigError(
                "a multi-node job needs NCCL_DDP_SECRET set to the same value on "
                "every node (e.g. from `python -c 'import secrets; "
                "print(secrets.token_hex(32))'`)"
            )


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
    except Exception as e:  # no pynvml, no driver: no GPU as far as we can tell
        log.debug("NVML unavailable (%s)", e)
        return 0


def resolve_nproc(nproc_per_node: int | str) -> int:
    if nproc_per_node != "auto":
        return int(nproc_per_node)
    gpus = local_device_count()
    if gpus == 0:
        log.info("no GPU found (nvidia-ml-py / driver); starting %d host processes", HOST_FALLBACK_NPROC)
    return gpus or HOST_FALLBACK_NPROC
