"""Who am I: rank, world size, local rank and rendezvous address of this process.

Sources, first match wins: explicit arguments, then the first launcher whose rank variable is set:
nccl-ddp-run / torchrun (RANK ...), Slurm (SLURM_PROCID ...), Open MPI (OMPI_COMM_WORLD_RANK ...).
MASTER_ADDR / MASTER_PORT apply whichever launcher set the rank. A process with none of these is a
job of one (rank 0, loopback, port chosen when the store binds).
"""
from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from nccl_ddp.errors import ConfigError, ConfigTypeError

LOOPBACK = "127.0.0.1"

# Launcher -> (rank, world size, local rank, local world size) variable names.
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)
_OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. `master_port` 0 means "pick a free port" (world size 1).

    `store_port` is where our store listens: NCCL_DDP_STORE_PORT when set (nccl-ddp-run sets it,
    leaving MASTER_PORT free for the script's own use, e.g. torch.distributed's env:// store);
    under torchrun, whose agent holds MASTER_PORT, MASTER_PORT + 1; else MASTER_PORT."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    secret: str = field(default="", repr=False)   # never logged
    store_hosted_externally: bool = False         # the launcher hosts the store; rank 0 is a client
    store_port: int = -1                          # -1: the same as master_port

    def __post_init__(self) -> None:
        if self.store_port == -1:
            object.__setattr__(self, "store_port", self.master_port)


def _int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or environ.get(name, "").strip() == "":
        return None
    raw = environ[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; "
                          f"set it to a whole number or unset it") from None


def env_int(name: str, default: int) -> int:
    """Integer environment variable `name` (ConfigError naming it if it is not one), else default."""
    value = _int(os.environ, name)
    return default if value is None else value


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Task count of node `node_id` from SLURM_TASKS_PER_NODE syntax such as "4(x2),3"."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}; "
                              f"set LOCAL_WORLD_SIZE explicitly")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ConfigError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE="
                          f"{tasks_per_node!r}; set LOCAL_WORLD_SIZE explicitly")
    return counts[node_id]


def slurm_first_host(nodelist: str) -> Optional[str]:
    """First host of a simple SLURM_NODELIST ("n1,n2", "gpu[03-06,9]"); None when it is not simple."""
    m = re.fullmatch(r"([\w.-]+)(?:\[(\d+)[^\]]*\])?(?:,.*)?", nodelist.strip())
    if not m:
        return None
    return m.group(1) + (m.group(2) or "")


def _slurm_local_world_size(environ: Mapping[str, str]) -> Optional[int]:
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").strip()
    if per_node.isdigit():
        return int(per_node)
    tasks = environ.get("SLURM_TASKS_PER_NODE", "").strip()
    if tasks:
        return slurm_tasks_on_node(tasks, _int(environ, "SLURM_NODEID") or 0)
    return None


def _slurm_master_addr(environ: Mapping[str, str]) -> Optional[str]:
    host = slurm_first_host(environ.get("SLURM_NODELIST", environ.get("SLURM_JOB_NODELIST", "")))
    return host or environ.get("SLURM_LAUNCH_NODE_IPADDR") or None


def _identity(environ: Mapping[str, str]) -> tuple[str, list[Optional[int]], Optional[str]]:
    """(source name, [rank, world, local rank, local world], master addr hint) of the first launcher."""
    for name, names in (("torchrun", _TORCHRUN), ("slurm", _SLURM), ("openmpi", _OMPI)):
        if environ.get(names[0], "").strip() == "":
            continue
        values = [_int(environ, n) for n in names]
        addr = None
        if name == "slurm":
            values[3] = _slurm_local_world_size(environ)
            addr = _slurm_master_addr(environ)
        return name, values, addr
    return "none", [None] * 4, None


def resolve_env(rank: Optional[int] = None, world_size: Optional[int] = None,
                local_rank: Optional[int] = None, master_addr: Optional[str] = None,
                master_port: Optional[int] = None,
                environ: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Work out this process's DistEnv; raises ConfigError naming the variable to fix."""
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank),
                        ("master_port", master_port)):
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, numbers.Integral)):
            raise ConfigTypeError(f"{name} must be an int or None (read from the environment), got "
                            f"{type(value).__name__} {value!r}")
    environ = os.environ if environ is None else environ
    source, (e_rank, e_world, e_local, e_local_world), addr_hint = _identity(environ)
    rank = e_rank if rank is None else rank
    world_size = e_world if world_size is None else world_size
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    elif world_size is None:
        raise ConfigError(f"rank {rank} is set ({source}) but the world size is not; "
                          f"set WORLD_SIZE (or pass world_size=)")
    elif rank is None:
        raise ConfigError(f"world size {world_size} is set ({source}) but the rank is not; "
                          f"set RANK (or pass rank=)")
    if world_size < 1:
        raise ConfigError(f"world size is {world_size}; set WORLD_SIZE to a positive integer")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size}) (from {source}); set RANK "
                          f"to a value below WORLD_SIZE")

    local_world = e_local_world if e_local_world is not None else world_size
    if local_world < 1:
        raise ConfigError(f"rank {rank}: local world size is {local_world}; set LOCAL_WORLD_SIZE "
                          f"to the number of ranks on this node")
    local_rank = e_local if local_rank is None else local_rank
    if local_rank is None:
        local_rank = rank % local_world
    if not 0 <= local_rank < local_world:
        raise ConfigError(f"rank {rank}: local rank {local_rank} is outside [0, {local_world}); "
                          f"set LOCAL_RANK below LOCAL_WORLD_SIZE")

    addr = master_addr or environ.get("MASTER_ADDR", "").strip() or addr_hint
    if not addr:
        if local_world < world_size:
            raise ConfigError(f"rank {rank}: the job spans several nodes ({world_size} ranks, "
                              f"{local_world} here) but MASTER_ADDR is not set; set it to the "
                              f"address of the node running rank 0")
        addr = LOOPBACK
    if master_port is None:
        master_port = _int(environ, "MASTER_PORT")
    if master_port is None:
        if world_size > 1:
            raise ConfigError(f"rank {rank}: world size {world_size} needs a rendezvous port but "
                              f"MASTER_PORT is not set; set it to the same free port on every rank")
        master_port = 0
    if not 0 <= master_port <= 65535 or (master_port == 0 and world_size > 1):
        raise ConfigError(f"rank {rank}: MASTER_PORT={master_port} is not a usable port; set it "
                          f"to a free port in 1..65535, the same on every rank")

    hosted = environ.get("NCCL_DDP_STORE_HOSTED", "").strip().lower() in ("1", "true", "yes")
    store_port = _int(environ, "NCCL_DDP_STORE_PORT")
    if store_port is None:
        torchrun_agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store_port = master_port + 1 if torchrun_agent and master_port else master_port
    if not 0 <= store_port <= 65535 or (store_port == 0 and world_size > 1):
        raise ConfigError(f"rank {rank}: NCCL_DDP_STORE_PORT={store_port} is not a usable port; "
                          f"set it to a free port in 1..65535, the same on every rank (or unset "
                          f"it to use MASTER_PORT)")
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank,
                   local_world_size=local_world, master_addr=addr, master_port=master_port,
                   secret=environ.get("NCCL_DDP_SECRET", ""), store_hosted_externally=hosted,
                   store_port=store_port)


# -- failure records for the launcher (like torchrun's error files) -----------------------------

ERROR_FILE_VAR = "NCCL_DDP_ERROR_FILE"    # nccl-ddp-run sets it: where this worker's record goes
_BLAME = re.compile(r"peer rank (\d+)")
_hook_installed = False


def blamed_rank(exc: BaseException) -> Optional[int]:
    """The peer an error blames ("peer rank 1 closed the connection"), along its causes."""
    seen = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        m = _BLAME.search(str(cur))
        if m:
            return int(m.group(1))
        cur = cur.__cause__ or cur.__context__
    return None


def record_failure(exc: BaseException, environ: Optional[Mapping[str, str]] = None) -> None:
    """Write why this worker fails to $NCCL_DDP_ERROR_FILE (once: the first failure wins), so
    the launcher can name the root cause instead of whichever rank exited first."""
    environ = os.environ if environ is None else environ
    path = environ.get(ERROR_FILE_VAR)
    if not path or os.path.exists(path):
        return
    import json
    import time
    rank = _int(environ, "RANK")
    record = {"rank": rank, "time": time.time(), "type": type(exc).__name__,
              "message": str(exc)[:4000], "blames": blamed_rank(exc), "pid": os.getpid()}
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass          # a record is a courtesy to the launcher; never mask the real error


def install_failure_hook() -> None:
    """Record an uncaught exception (sys.excepthook) when the launcher asked for records."""
    global _hook_installed
    if _hook_installed or not os.environ.get(ERROR_FILE_VAR):
        return
    import sys
    previous = sys.excepthook

    def hook(tp, value, tb):
        record_failure(value)
        previous(tp, value, tb)

    sys.excepthook = hook
    _hook_installed = True


DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


def debug_level(environ: Optional[Mapping[str, str]] = None) -> str:
    """NCCL_DDP_DEBUG: OFF (default), INFO or DETAIL (every NCCL collective is compared across
    ranks before it runs; see nccl_ddp.comm.desync)."""
    environ = os.environ if environ is None else environ
    value = environ.get("NCCL_DDP_DEBUG", "").strip().upper() or "OFF"
    if value not in DEBUG_LEVELS:
        raise ConfigError(f"NCCL_DDP_DEBUG={environ.get('NCCL_DDP_DEBUG')!r}: use one of "
                          f"{', '.join(DEBUG_LEVELS)} (or unset it)")
    return value
