"""Who am I: rank, world size, local rank and rendezvous address of this process.

Sources, first match wins: explicit arguments, then the first launcher whose variables are set:
nccl-ddp-run / torchrun (RANK ...), Lightning's launcher (WORLD_SIZE, NODE_RANK, LOCAL_RANK, no
RANK), msrun (MS_ROLE, RANK_ID, MS_WORKER_NUM ...), Slurm (SLURM_PROCID ...), Open MPI
(OMPI_COMM_WORLD_RANK ...), MPICH / Intel MPI (PMI_RANK ...). MASTER_ADDR / MASTER_PORT apply
whichever launcher set the rank. A process with none of these is a job of one (rank 0, loopback,
port chosen when the store binds); a process that some launcher says is one of several but that
would still resolve to a job of one is refused (`_check_not_alone`): it would train alone, silently.
What each launcher exports is read in launcher_env.py; this module checks it and adds the ports.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.job.launcher_env import (
    LAUNCHER_NAMES,
    MSRUN_RANK_HINT,
    WORLD_VARS,
    LauncherVars,
    identify,
    launcher_ranks,
    node_rank,
    read_int,
    slurm_first_node,
    slurm_tasks_on_node,
)

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT = 300.0
"""Seconds any blocking wait gives up after unless told otherwise: `init_process_group(timeout=)`,
the store, a device stream's synchronize, the Lightning/Accelerate glue's group, the profiler's
end of step. One number, so a job has one default bound."""

__all__ = [
    "DEFAULT_TIMEOUT",
    "LOOPBACK",
    "DistEnv",
    "debug_level",
    "env_int",
    "launcher_ranks",
    "node_rank",
    "resolve_env",
    "slurm_first_node",
    "slurm_tasks_on_node",
]


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. `master_port` 0 means "pick a free port" (world size 1).

    `store_port` is where our store listens: NCCL_DDP_STORE_PORT when set (nccl-ddp-run sets it,
    leaving MASTER_PORT free for the script's own use, e.g. torch.distributed's env:// store);
    next to the port another store holds: MASTER_PORT + 1 under torchrun (its agent's store) and
    under Lightning's launcher (rank 0's torch TCPStore), MS_SCHED_PORT - 1 under msrun (its
    scheduler holds MS_SCHED_PORT, and MindSpore's workers take ports counting up from 8118,
    msrun's default scheduler port); else MASTER_PORT. `source` names the launcher it came from
    ("none": a plain `python train.py`); `ms_scheduler`: this is msrun's scheduler process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    secret: str = field(default="", repr=False)  # never logged
    store_hosted_externally: bool = False  # the launcher hosts the store; rank 0 is a client
    store_port: int = -1  # -1: the same as master_port
    source: str = "none"
    world_from: str = field(default="", compare=False)  # "OMPI_COMM_WORLD_SIZE=2 (Open MPI)"
    ms_scheduler: bool = False

    def __post_init__(self) -> None:
        if self.store_port == -1:
            object.__setattr__(self, "store_port", self.master_port)


def env_int(name: str, default: int) -> int:
    """Integer environment variable `name` (ConfigError naming it if it is not one), else default."""
    value = read_int(os.environ, name)
    return default if value is None else value


def _claims(environ: Mapping[str, str], source: str) -> dict:
    """The variables that say the job has more than one process. Slurm's count describes the
    allocation, which may hold a launcher of its own: it counts only when no launcher was found."""
    names = WORLD_VARS + (("SLURM_NTASKS",) if source in ("none", "arguments") else ())
    return {
        n: environ[n].strip() for n in names if environ.get(n, "").strip().isdigit() and int(environ[n]) > 1
    }


def _check_not_alone(environ: Mapping[str, str], source: str, world_size: int) -> None:
    """Refuse a job of one that a launcher says is one of several: it would train alone."""
    claims = _claims(environ, source) if world_size == 1 else {}
    if not claims:
        return
    seen = ", ".join(f"{k}={v}" for k, v in claims.items())
    if source == "arguments":
        fix = (
            "pass the world_size and rank that launcher set (or leave them out to read them "
            "from the environment), or unset those variables to run alone"
        )
    elif "MS_WORKER_NUM" in claims or "RANK_SIZE" in claims:
        fix = MSRUN_RANK_HINT
    else:
        fix = (
            "set RANK (or the launcher's rank variable) on every process, or unset those "
            "variables to run alone"
        )
    raise ConfigError(
        f"the environment says this job has more than one process ({seen}) but "
        f"nccl_ddp resolved a job of one (from {LAUNCHER_NAMES[source]}): each process would "
        f"train alone; {fix}"
    )


def resolve_env(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> DistEnv:
    """Work out this process's DistEnv; raises ConfigError naming the variable to fix."""
    _check_int_args(rank=rank, world_size=world_size, local_rank=local_rank, master_port=master_port)
    environ = os.environ if environ is None else environ
    found = identify(environ)
    source = "arguments" if world_size is not None else found.source
    rank, world_size = _rank_and_world(found, source, rank, world_size)
    _check_not_alone(environ, source, world_size)
    local_rank, local_world = _local_rank_and_world(found, rank, world_size, local_rank)
    addr = _master_addr(environ, found, master_addr, rank, world_size, local_world)
    master_port = _master_port(environ, found, master_port, rank, world_size)
    hosted = environ.get("NCCL_DDP_STORE_HOSTED", "").strip().lower() in ("1", "true", "yes")
    store_port = _store_port(environ, found, master_port, rank, world_size)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=master_port,
        secret=environ.get("NCCL_DDP_SECRET", ""),
        store_hosted_externally=hosted,
        store_port=store_port,
        source=source,
        ms_scheduler=found.ms_scheduler,
        world_from=_world_from(environ, source, found.names[1], world_size),
    )


def _check_int_args(**args: Optional[int]) -> None:
    """The integer arguments of `resolve_env` are ints or None (bool refused), named when not."""
    for name, value in args.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ConfigTypeError(
                f"{name} must be an int or None (read from the environment), got "
                f"{type(value).__name__} {value!r}"
            )


def _rank_and_world(
    found: LauncherVars, source: str, rank: Optional[int], world_size: Optional[int]
) -> Tuple[int, int]:
    """Rank and world size, the arguments before the launcher's; both unset: a job of one."""
    rank_var, world_var = found.names[0], found.names[1]
    e_rank, e_world = found.values[0], found.values[1]
    rank = e_rank if rank is None else rank
    world_size = e_world if world_size is None else world_size
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    elif world_size is None:
        raise ConfigError(
            f"rank {rank} is set ({LAUNCHER_NAMES[source]}) but the world size is not; "
            f"set {world_var or 'WORLD_SIZE'} (or pass world_size=)"
        )
    elif rank is None:
        hint = MSRUN_RANK_HINT if found.source == "msrun" else f"set {rank_var} (or pass rank=)"
        raise ConfigError(
            f"world size {world_size} is set ({LAUNCHER_NAMES[source]}) but the rank is not; {hint}"
        )
    if world_size < 1:
        raise ConfigError(f"world size is {world_size}; set {world_var} to a positive integer")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} is outside [0, {world_size}) (from {LAUNCHER_NAMES[source]}); set "
            f"{rank_var} to a value below {world_var}"
        )
    return rank, world_size


def _local_rank_and_world(
    found: LauncherVars, rank: int, world_size: int, local_rank: Optional[int]
) -> Tuple[int, int]:
    """Local rank and ranks on this node; unset: one node (rank modulo the local world size)."""
    local_var, local_world_var = found.names[2], found.names[3]
    e_local, e_local_world = found.values[2], found.values[3]
    local_world = e_local_world if e_local_world is not None else world_size
    if local_world < 1:
        raise ConfigError(
            f"rank {rank}: local world size is {local_world}; set {local_world_var} "
            f"to the number of ranks on this node"
        )
    local_rank = e_local if local_rank is None else local_rank
    if local_rank is None:
        local_rank = rank % local_world
    if not 0 <= local_rank < local_world:
        raise ConfigError(
            f"rank {rank}: local rank {local_rank} is outside [0, {local_world}); "
            f"set {local_var} below {local_world_var}"
        )
    return local_rank, local_world


def _master_addr(
    environ: Mapping[str, str],
    found: LauncherVars,
    master_addr: Optional[str],
    rank: int,
    world_size: int,
    local_world: int,
) -> str:
    """The rendezvous host: the argument, MASTER_ADDR, the launcher's; loopback on one node only."""
    addr = master_addr or environ.get("MASTER_ADDR", "").strip() or found.addr
    if not addr:
        if local_world < world_size:
            raise ConfigError(
                f"rank {rank}: the job spans several nodes ({world_size} ranks, "
                f"{local_world} here) but MASTER_ADDR is not set; set it to the "
                f"address of the node running rank 0"
            )
        addr = LOOPBACK
    return addr


def _master_port(
    environ: Mapping[str, str], found: LauncherVars, master_port: Optional[int], rank: int, world_size: int
) -> int:
    """The rendezvous port: the argument, MASTER_PORT, the launcher's store; 0 (free) for one rank."""
    if master_port is None:
        master_port = read_int(environ, "MASTER_PORT")
    if master_port is None and found.store_port is not None:
        master_port = found.store_port  # msrun: no MASTER_PORT; the store's port is the rendezvous
    if master_port is None:
        if world_size > 1:
            raise ConfigError(
                f"rank {rank}: world size {world_size} needs a rendezvous port but "
                f"MASTER_PORT is not set; set it to the same free port on every rank"
            )
        master_port = 0
    if not 0 <= master_port <= 65535 or (master_port == 0 and world_size > 1):
        raise ConfigError(
            f"rank {rank}: MASTER_PORT={master_port} is not a usable port; set it "
            f"to a free port in 1..65535, the same on every rank"
        )
    return master_port


def _store_port(
    environ: Mapping[str, str], found: LauncherVars, master_port: int, rank: int, world_size: int
) -> int:
    """Our store's port: NCCL_DDP_STORE_PORT, else beside the launcher's store (DistEnv says where)."""
    store_port = read_int(environ, "NCCL_DDP_STORE_PORT")
    if store_port is None:
        store_port = (
            master_port + 1
            if found.store_after_master and master_port
            else found.store_port
            if found.store_port is not None
            else master_port
        )
    if not 0 <= store_port <= 65535 or (store_port == 0 and world_size > 1):
        raise ConfigError(
            f"rank {rank}: NCCL_DDP_STORE_PORT={store_port} is not a usable port; "
            f"set it to a free port in 1..65535, the same on every rank (or unset "
            f"it to use MASTER_PORT)"
        )
    return store_port


def _world_from(environ: Mapping[str, str], source: str, world_var: Optional[str], world_size: int) -> str:
    """Where the world size came from, for messages while ranks are awaited."""
    if source == "arguments":
        return f"world_size={world_size} (the arguments)"
    if source == "none" or not world_var:
        return "no launcher variable (a job of one)"
    return f"{world_var}={environ.get(world_var, '').strip()} ({LAUNCHER_NAMES[source]})"


DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


def debug_level(environ: Optional[Mapping[str, str]] = None) -> str:
    """NCCL_DDP_DEBUG: OFF (default), INFO or DETAIL (every NCCL collective is compared across
    ranks before it runs; see nccl_ddp.comm.desync)."""
    environ = os.environ if environ is None else environ
    value = environ.get("NCCL_DDP_DEBUG", "").strip().upper() or "OFF"
    if value not in DEBUG_LEVELS:
        raise ConfigError(
            f"NCCL_DDP_DEBUG={environ.get('NCCL_DDP_DEBUG')!r}: use one of "
            f"{', '.join(DEBUG_LEVELS)} (or unset it)"
        )
    return value
