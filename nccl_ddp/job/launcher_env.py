"""What each launcher exports: the variables that say a process's rank, world size and node.

First match wins: nccl-ddp-run / torchrun (RANK ...), Lightning's launcher (WORLD_SIZE, NODE_RANK,
LOCAL_RANK, no RANK), msrun (MS_ROLE, RANK_ID, MS_WORKER_NUM ...), Slurm (SLURM_PROCID ...), Open
MPI (OMPI_COMM_WORLD_RANK ...), MPICH / Intel MPI (PMI_RANK ...). `env.resolve_env` checks what
this module reads and turns it into a DistEnv.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

from nccl_ddp.errors import ConfigError

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
WORLD_VARS = ("WORLD_SIZE", "MS_WORKER_NUM", "RANK_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LAUNCHER_NAMES = {
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
MSRUN_RANK_HINT = (
    "msrun exports RANK_ID on one node, and on several only with --node_rank "
    "(else MindSpore assigns ranks inside mindspore.communication.init()): pass "
    "--node_rank to msrun on every node, or pass "
    "rank=mindspore.communication.get_rank() to init_process_group after "
    "mindspore.communication.init()"
)


def read_int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or environ.get(name, "").strip() == "":
        return None
    raw = environ[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer; set it to a whole number or unset it"
        ) from None


NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")  # ours / torchrun, Lightning, Slurm


def node_rank(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """This process's node in the launcher's topology (nccl-ddp-run and torchrun export
    GROUP_RANK), or None where no launcher says: which ranks share a node is the launcher's word,
    not the hostname's (two `--node-rank`s on one machine are two nodes)."""
    for name in NODE_RANK_VARS:
        value = read_int(environ, name)
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


def slurm_first_node(nodelist: str) -> Optional[str]:
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
        return slurm_tasks_on_node(tasks, read_int(environ, "SLURM_NODEID") or 0)
    return None


def _slurm_master_addr(environ: Mapping[str, str]) -> Optional[str]:
    host = slurm_first_node(environ.get("SLURM_NODELIST", environ.get("SLURM_JOB_NODELIST", "")))
    return host or environ.get("SLURM_LAUNCH_NODE_IPADDR") or None


@dataclass(frozen=True)
class LauncherVars:
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


def _lightning(environ: Mapping[str, str]) -> LauncherVars:
    """Lightning's launcher: no RANK; rank = NODE_RANK * processes per node + LOCAL_RANK. It does
    not export the processes per node: LOCAL_WORLD_SIZE, or on node 0 none is needed."""
    node, local = read_int(environ, "NODE_RANK") or 0, read_int(environ, "LOCAL_RANK")
    local_world = read_int(environ, "LOCAL_WORLD_SIZE")
    if node > 0 and local_world is None:
        raise ConfigError(
            f"Lightning's launcher (WORLD_SIZE={environ['WORLD_SIZE']}, "
            f"NODE_RANK={node}, LOCAL_RANK={local}, no RANK): the rank on node "
            f"{node} needs the processes per node; set LOCAL_WORLD_SIZE to "
            f"Trainer(devices=...) on every node, or set RANK"
        )
    rank = local if node == 0 else node * local_world + local  # type: ignore[operator]
    return LauncherVars(
        "lightning",
        ("NODE_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK",) + _TORCHRUN[1:],
        (rank, read_int(environ, "WORLD_SIZE"), local, local_world),
        store_after_master=True,
    )


def _msrun(environ: Mapping[str, str]) -> LauncherVars:
    world_var = "MS_WORKER_NUM" if _set(environ, "MS_WORKER_NUM") else "RANK_SIZE"
    names = (_MSRUN[0], world_var) + _MSRUN[2:]
    sched_port = read_int(environ, "MS_SCHED_PORT")
    return LauncherVars(
        "msrun",
        names,
        tuple(read_int(environ, n) for n in names),
        addr=environ.get("MS_SCHED_HOST", "").strip() or None,
        store_port=sched_port - 1 if sched_port else None,
        ms_scheduler=environ.get("MS_ROLE", "").strip() == _MS_SCHEDULER,
    )


def _torchrun(environ: Mapping[str, str]) -> LauncherVars:
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    return LauncherVars(
        "torchrun", _TORCHRUN, tuple(read_int(environ, n) for n in _TORCHRUN), store_after_master=agent
    )


def _slurm(environ: Mapping[str, str]) -> LauncherVars:
    values = [read_int(environ, n) for n in _SLURM]
    values[3] = _slurm_local_world_size(environ)
    return LauncherVars("slurm", _SLURM, tuple(values), addr=_slurm_master_addr(environ))


def _mpi(source: str, names: tuple) -> Callable[[Mapping[str, str]], LauncherVars]:
    """Open MPI's or MPICH's reader: its four variables as they are."""
    return lambda environ: LauncherVars(source, names, tuple(read_int(environ, n) for n in names))


# Each launcher: the variables that mark it (all set), its reader. First match wins.
_LAUNCHERS: Tuple[Tuple[Tuple[str, ...], Callable[[Mapping[str, str]], LauncherVars]], ...] = (
    (("RANK",), _torchrun),
    (("WORLD_SIZE", "LOCAL_RANK"), _lightning),
    (("MS_ROLE",), _msrun),
    (("RANK_ID",), _msrun),
    ((_SLURM[0],), _slurm),
    ((_OMPI[0],), _mpi("openmpi", _OMPI)),
    ((_PMI[0],), _mpi("pmi", _PMI)),
)


def identify(environ: Mapping[str, str]) -> LauncherVars:
    """What the first launcher whose variables are set says about this process."""
    for marks, read in _LAUNCHERS:
        if all(_set(environ, m) for m in marks):
            return read(environ)
    return LauncherVars("none", _TORCHRUN, (None,) * 4)


def launcher_ranks(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, Optional[int], Optional[int]]:
    """(launcher name, rank, world size) as the first launcher whose variables are set says
    (None: unset; "none" when no launcher's are): who this process is before a port is known."""
    found = identify(os.environ if environ is None else environ)
    return found.source, found.values[0], found.values[1]
