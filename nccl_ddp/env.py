"""Who am I: rank, world size, local rank and rendezvous address of this process.

Sources, first match wins: explicit arguments, then the first launcher whose variables are set:
nccl-ddp-run / torchrun (RANK ...), Lightning's launcher (WORLD_SIZE, NODE_RANK, LOCAL_RANK, no
RANK), msrun (MS_ROLE, RANK_ID, MS_WORKER_NUM ...), Slurm (SLURM_PROCID ...), Open MPI
(OMPI_COMM_WORLD_RANK ...), MPICH / Intel MPI (PMI_RANK ...). MASTER_ADDR / MASTER_PORT apply
whichever launcher set the rank. A process with none of these is a job of one (rank 0, loopback,
port chosen when the store binds); a process that some launcher says is one of several but that
would still resolve to a job of one is refused (`_check_not_alone`): it would train alone, silently.
"""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from nccl_ddp.errors import ConfigError, ConfigTypeError

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT = 300.0
"""Seconds any blocking wait gives up after unless told otherwise: `init_process_group(timeout=)`,
the store, a device stream's synchronize, the Lightning/Accelerate glue's group, the profiler's
end of step. One number, so a job has one default bound."""

# Launcher -> (rank, world size, local rank, local world size) variable names.
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)
_OMPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_PMI = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # MPICH hydra, Intel MPI
# msrun: RANK_ID (= MS_NODE_ID; unset on a node started without --node_rank until MindSpore's
# init() assigns it), MS_WORKER_NUM (= RANK_SIZE, all nodes), DEVICE_ID (the index on this node)
_MSRUN = ("RANK_ID", "MS_WORKER_NUM", "DEVICE_ID", "LOCAL_WORLD_SIZE")
# every variable by which a launcher or scheduler says how many processes the job has
_WORLD_VARS = ("WORLD_SIZE", "MS_WORKER_NUM", "RANK_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_NAMES = {
    "torchrun": "torchrun / nccl-ddp-run",
    "lightning": "Lightning's launcher",
    "msrun": "msrun",
    "slurm": "Slurm",
    "openmpi": "Open MPI",
    "pmi": "MPICH / Intel MPI",
    "arguments": "the arguments",
    "none": "no launcher",
}
_MS_SCHEDULER = "MS_SCHED"  # MS_ROLE of the process msrun starts as MindSpore's scheduler
_MSRUN_RANK_HINT = (
    "msrun exports RANK_ID on one node, and on several only with --node_rank "
    "(else MindSpore assigns ranks inside mindspore.communication.init()): pass "
    "--node_rank to msrun on every node, or pass "
    "rank=mindspore.communication.get_rank() to init_process_group after "
    "mindspore.communication.init()"
)


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


def _int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or environ.get(name, "").strip() == "":
        return None
    raw = environ[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer; set it to a whole number or unset it"
        ) from None


def env_int(name: str, default: int) -> int:
    """Integer environment variable `name` (ConfigError naming it if it is not one), else default."""
    value = _int(os.environ, name)
    return default if value is None else value


NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")  # ours / torchrun, Lightning, Slurm


def node_rank(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """This process's node in the launcher's topology (nccl-ddp-run and torchrun export
    GROUP_RANK), or None where no launcher says: which ranks share a node is the launcher's word,
    not the hostname's (two `--node-rank`s on one machine are two nodes)."""
    for name in NODE_RANK_VARS:
        value = _int(environ, name)
        if value is not None:
            return value
    return None


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Task count of node `node_id` from SLURM_TASKS_PER_NODE syntax such as "4(x2),3"."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(
                f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}; set LOCAL_WORLD_SIZE explicitly"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ConfigError(
            f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE="
            f"{tasks_per_node!r}; set LOCAL_WORLD_SIZE explicitly"
        )
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


@dataclass(frozen=True)
class _Found:
    """What the first launcher found says: its name and variable names, the values (None: unset),
    a rendezvous host / store port to use when MASTER_ADDR / NCCL_DDP_STORE_PORT are not set."""

    source: str
    names: tuple
    values: tuple
    addr: Optional[str] = None
    store_port: Optional[int] = None
    store_after_master: bool = False  # a torch store holds MASTER_PORT: ours takes the next
    ms_scheduler: bool = False


def _set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip() != ""


def _lightning(environ: Mapping[str, str]) -> _Found:
    """Lightning's launcher: no RANK; rank = NODE_RANK * processes per node + LOCAL_RANK. It does
    not export the processes per node: LOCAL_WORLD_SIZE, or on node 0 none is needed."""
    node, local = _int(environ, "NODE_RANK") or 0, _int(environ, "LOCAL_RANK")
    local_world = _int(environ, "LOCAL_WORLD_SIZE")
    if node > 0 and local_world is None:
        raise ConfigError(
            f"Lightning's launcher (WORLD_SIZE={environ['WORLD_SIZE']}, "
            f"NODE_RANK={node}, LOCAL_RANK={local}, no RANK): the rank on node "
            f"{node} needs the processes per node; set LOCAL_WORLD_SIZE to "
            f"Trainer(devices=...) on every node, or set RANK"
        )
    rank = local if node == 0 else node * local_world + local  # type: ignore[operator]
    return _Found(
        "lightning",
        ("NODE_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK",) + _TORCHRUN[1:],
        (rank, _int(environ, "WORLD_SIZE"), local, local_world),
        store_after_master=True,
    )


def _msrun(environ: Mapping[str, str]) -> _Found:
    world_var = "MS_WORKER_NUM" if _set(environ, "MS_WORKER_NUM") else "RANK_SIZE"
    names = (_MSRUN[0], world_var) + _MSRUN[2:]
    sched_port = _int(environ, "MS_SCHED_PORT")
    return _Found(
        "msrun",
        names,
        tuple(_int(environ, n) for n in names),
        addr=environ.get("MS_SCHED_HOST", "").strip() or None,
        store_port=sched_port - 1 if sched_port else None,
        ms_scheduler=environ.get("MS_ROLE", "").strip() == _MS_SCHEDULER,
    )


def _identity(environ: Mapping[str, str]) -> _Found:
    """What the first launcher whose variables are set says about this process."""
    if _set(environ, "RANK"):
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
        return _Found(
            "torchrun", _TORCHRUN, tuple(_int(environ, n) for n in _TORCHRUN), store_after_master=agent
        )
    if _set(environ, "WORLD_SIZE") and _set(environ, "LOCAL_RANK"):
        return _lightning(environ)
    if _set(environ, "MS_ROLE") or _set(environ, "RANK_ID"):
        return _msrun(environ)
    for name, names in (("slurm", _SLURM), ("openmpi", _OMPI), ("pmi", _PMI)):
        if not _set(environ, names[0]):
            continue
        values = [_int(environ, n) for n in names]
        addr = None
        if name == "slurm":
            values[3] = _slurm_local_world_size(environ)
            addr = _slurm_master_addr(environ)
        return _Found(name, names, tuple(values), addr=addr)
    return _Found("none", _TORCHRUN, (None,) * 4)


def launcher_ranks(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, Optional[int], Optional[int]]:
    """(launcher name, rank, world size) as the first launcher whose variables are set says
    (None: unset; "none" when no launcher's are): who this process is before a port is known."""
    found = _identity(os.environ if environ is None else environ)
    return found.source, found.values[0], found.values[1]


def _claims(environ: Mapping[str, str], source: str) -> dict:
    """The variables that say the job has more than one process. Slurm's count describes the
    allocation, which may hold a launcher of its own: it counts only when no launcher was found."""
    names = _WORLD_VARS + (("SLURM_NTASKS",) if source in ("none", "arguments") else ())
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
        fix = _MSRUN_RANK_HINT
    else:
        fix = (
            "set RANK (or the launcher's rank variable) on every process, or unset those "
            "variables to run alone"
        )
    raise ConfigError(
        f"the environment says this job has more than one process ({seen}) but "
        f"nccl_ddp resolved a job of one (from {_NAMES[source]}): each process would "
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
    found = _identity(environ)
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
        source=found.source if source != "arguments" else source,
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
    found: _Found, source: str, rank: Optional[int], world_size: Optional[int]
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
            f"rank {rank} is set ({_NAMES[source]}) but the world size is not; "
            f"set {world_var or 'WORLD_SIZE'} (or pass world_size=)"
        )
    elif rank is None:
        hint = _MSRUN_RANK_HINT if found.source == "msrun" else f"set {rank_var} (or pass rank=)"
        raise ConfigError(f"world size {world_size} is set ({_NAMES[source]}) but the rank is not; {hint}")
    if world_size < 1:
        raise ConfigError(f"world size is {world_size}; set {world_var} to a positive integer")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} is outside [0, {world_size}) (from {_NAMES[source]}); set "
            f"{rank_var} to a value below {world_var}"
        )
    return rank, world_size


def _local_rank_and_world(
    found: _Found, rank: int, world_size: int, local_rank: Optional[int]
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
    found: _Found,
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
    environ: Mapping[str, str], found: _Found, master_port: Optional[int], rank: int, world_size: int
) -> int:
    """The rendezvous port: the argument, MASTER_PORT, the launcher's store; 0 (free) for one rank."""
    if master_port is None:
        master_port = _int(environ, "MASTER_PORT")
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
    environ: Mapping[str, str], found: _Found, master_port: int, rank: int, world_size: int
) -> int:
    """Our store's port: NCCL_DDP_STORE_PORT, else beside the launcher's store (DistEnv says where)."""
    store_port = _int(environ, "NCCL_DDP_STORE_PORT")
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
    return f"{world_var}={environ.get(world_var, '').strip()} ({_NAMES[source]})"


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
