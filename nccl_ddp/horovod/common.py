"""What every Horovod framework API shares, framework-free: init and the ranks, Horovod's
settings, and the list of basics each API re-exports (process sets from process_sets.py and the
object collectives from objects.py among them; the handles of asynchronous ops are in handles.py).

Horovod's names and meanings (horovod/common/basics.py, process_sets.py): `cross_rank` is this
process's rank among the processes with its local rank, `cross_size` their number; a
`ProcessSet(ranks)` is an `nccl_ddp.new_group(ranks)` once registered (at `init(process_sets=...)`
or by `add_process_set`, which every rank calls, as in Horovod).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence, Tuple

import numpy as np

import nccl_ddp as nd
from nccl_ddp.comm.api import get_local_world_size
from nccl_ddp.errors import CommError, ConfigError, ConfigTypeError
from nccl_ddp.horovod import negotiation
from nccl_ddp.horovod.objects import allgather_object, broadcast_object
from nccl_ddp.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    group_of,
    invalidate_all,
    remove_process_set,
)

log = logging.getLogger(__name__)

# Horovod's basics that every framework API (`nccl_ddp.horovod.torch`, `.tensorflow`, `.keras`)
# re-exports with `from nccl_ddp.horovod.common import *`; each adds its own names
__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather_object",
    "barrier",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "nccl_built",
    "rank",
    "remove_process_set",
    "shutdown",
    "size",
]

# Horovod's op constants (the values of horovod.common.basics' enum)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

HorovodInternalError = CommError
"""What Horovod raises when a collective fails (a peer died): here our `CommError`, so
`except hvd.HorovodInternalError` catches it."""

# HOROVOD_* variables of Horovod's runtime that have no meaning here: said once, never ignored silently
_NOT_APPLICABLE = {
    "HOROVOD_CYCLE_TIME": "buckets launch as soon as their grads are ready",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "NCCL picks its own algorithms",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "NCCL picks its own algorithms",
    "HOROVOD_CACHE_CAPACITY": "there is no response cache to size",
    "HOROVOD_AUTOTUNE": "bucket sizes come from HOROVOD_FUSION_THRESHOLD (or our 25 MiB default)",
    "HOROVOD_TIMELINE": "use nccl_ddp's timeline (docs/profiling.md)",
}
# Horovod's launcher variables -> the ones nccl_ddp.job.env reads
_LAUNCHER_VARS = {
    "HOROVOD_RANK": "RANK",
    "HOROVOD_SIZE": "WORLD_SIZE",
    "HOROVOD_LOCAL_RANK": "LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
}


def resolve_op(op: object, average: object, where: str) -> int:
    """Horovod's `op` (None: Average) with its deprecated `average=` flag; Adasum is refused."""
    if average is not None:
        if op is not None:
            raise ConfigError(f"{where}: pass op= or the deprecated average=, not both")
        if not isinstance(average, bool):
            raise ConfigTypeError(
                f"{where}: average must be a bool, got {type(average).__name__} {average!r}"
            )
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or not isinstance(op, (int, np.integer)) or int(op) not in OP_NAMES:
        raise ConfigError(
            f"{where}: unknown op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product"
        )
    if op == Adasum:
        raise ConfigError(
            f"{where}: op=hvd.Adasum is not supported by nccl_ddp (Horovod's adaptive summation "
            "has no implementation here); use op=hvd.Average (the default) or hvd.Sum"
        )
    return int(op)


def check_scale(where: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigTypeError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------
# init and the ranks


class _State:
    owns_group = False  # init() created nccl_ddp's process group (shutdown destroys it)
    local_size = 1
    cross_rank = 0
    cross_size = 1


_state = _State()


def init(comm: object = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Join the job (nccl_ddp.init_process_group: the launcher's variables, Horovod's
    HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE too) and register `process_sets`. Collective."""
    if comm is not None:
        raise ConfigError(
            "hvd.init(comm=...): an MPI communicator or a subset of ranks is not supported; every "
            "process of the job takes part (use process_sets=[hvd.ProcessSet(ranks)] for subsets)"
        )
    if not nd.is_initialized():
        _map_horovod_launcher_vars()
        nd.init_process_group()
        _state.owns_group = True
    _warn_not_applicable()
    me, local = nd.get_rank(), nd.get_local_rank()
    _state.local_size = get_local_world_size()
    global_process_set._register(nd.get_world_group())
    locals_ = allgather_object(local)
    mine = [r for r, lr in enumerate(locals_) if lr == local]
    _state.cross_rank, _state.cross_size = mine.index(me), len(mine)
    for k, v in (
        ("HOROVOD_RANK", me),
        ("HOROVOD_SIZE", nd.get_world_size()),
        ("HOROVOD_LOCAL_RANK", local),
        ("HOROVOD_LOCAL_SIZE", _state.local_size),
        ("HOROVOD_CROSS_RANK", _state.cross_rank),
        ("HOROVOD_CROSS_SIZE", _state.cross_size),
    ):
        os.environ.setdefault(k, str(v))  # what Horovod's launcher gives its workers
    for ps in process_sets or ():
        add_process_set(ps)


def _map_horovod_launcher_vars() -> None:
    """Started by Horovod's own launcher in gloo mode: read its variables as ours."""
    if "RANK" in os.environ or "HOROVOD_RANK" not in os.environ:
        return
    for theirs, ours in _LAUNCHER_VARS.items():
        if theirs in os.environ:
            os.environ.setdefault(ours, os.environ[theirs])
    log.info("nccl_ddp.horovod: rank and size from HOROVOD_RANK / HOROVOD_SIZE")


_warned = False


def _warn_not_applicable() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    for name, why in _NOT_APPLICABLE.items():
        if os.environ.get(name, "").strip():
            log.warning("nccl_ddp.horovod: %s is set but has no effect here: %s", name, why)


def fusion_threshold_mb() -> Optional[float]:
    """HOROVOD_FUSION_THRESHOLD (bytes) as a bucket cap in MiB; None: our default (25 MiB)."""
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"HOROVOD_FUSION_THRESHOLD={raw!r} is not a whole number of bytes; set e.g. 67108864 "
            "(64 MiB) or unset it"
        ) from None
    if value < 0:
        raise ConfigError(f"HOROVOD_FUSION_THRESHOLD={value} is negative; set a number of bytes >= 0")
    return value / 2**20


def shutdown() -> None:
    """Leave the job (destroys nccl_ddp's process group if init() created it)."""
    negotiation.reset("hvd.shutdown() was called while this op was pending")
    invalidate_all()
    if _state.owns_group:
        _state.owns_group = False
        nd.destroy_process_group()


def is_initialized() -> bool:
    return nd.is_initialized() and global_process_set._group is not None


def _check_init(what: str) -> None:
    if global_process_set._group is None:
        raise ConfigError(f"hvd.{what}(): Horovod has not been initialized; call hvd.init() first")


def size() -> int:
    _check_init("size")
    return nd.get_world_size()


def rank() -> int:
    _check_init("rank")
    return nd.get_rank()


def local_rank() -> int:
    _check_init("local_rank")
    return nd.get_local_rank()


def local_size() -> int:
    _check_init("local_size")
    return _state.local_size


def cross_rank() -> int:
    _check_init("cross_rank")
    return _state.cross_rank


def cross_size() -> int:
    _check_init("cross_size")
    return _state.cross_size


def is_homogeneous() -> bool:
    return size() == local_size() * cross_size()


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    """True when this node can run NCCL collectives (CuPy sees a GPU and loads NCCL)."""
    from nccl_ddp.comm.nccl.runtime import is_available

    return is_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when CUDA tensors can take part (CuPy sees a GPU)."""
    from nccl_ddp.device.cuda import cuda_available

    return cuda_available()


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise ConfigError(
        "hvd.start_timeline: Horovod's timeline is not available; nccl_ddp records its own "
        "per-step timeline (docs/profiling.md)"
    )


def stop_timeline() -> None:
    start_timeline("")


# ---------------------------------------------------------------------------------------------
# objects (objects.py), barrier, join


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Every member reached it (matched with the others' pending ops, as Horovod's)."""
    negotiation.barrier(group_of(process_set or global_process_set, "hvd.barrier"))


def join(device: int = -1) -> int:
    """Horovod's join: until every rank has joined, this rank's zeros take part in the others'
    allreduces (other collectives are refused meanwhile); returns the rank that joined last."""
    return negotiation.join(global_process_set.group("hvd.join"))


def split_counts(total: int, parts: int) -> Tuple[int, ...]:
    """Horovod's split of `total` rows over `parts` ranks: the first `total % parts` get one more."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))
