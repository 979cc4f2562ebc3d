"""The world group, torch.distributed's way: its lifecycle, its queries, the groups made from it.

One world group per process, joined from any launcher's variables; `new_group` and the
`group=` resolution work on it. The collectives on DLPack arrays are in `comm/collectives.py`.

    nd.init_process_group()                  # env from nccl-ddp-run / torchrun / Slurm / MPI
    nd.get_rank(), nd.get_world_size()
    nd.destroy_process_group()
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Optional, Sequence, Union, cast

import numpy as np

from nccl_ddp.comm.backends import backend_name
from nccl_ddp.comm.group import NonMemberGroup, ProcessGroup
from nccl_ddp.device import CudaDevice, Device, get_device
from nccl_ddp.errors import (
    CommTimeout,
    ConfigError,
    ConfigTypeError,
    NcclDdpError,
    RankMismatchError,
    StoreTimeout,
)
from nccl_ddp.job.env import DEFAULT_TIMEOUT, DistEnv, resolve_env
from nccl_ddp.job.failure_record import install_failure_hook

log = logging.getLogger(__name__)

_inits = itertools.count(1)  # init_process_group calls so far: fresh store keys for each
INIT_KEYS = "nccl_ddp/init"  # their prefix (nccl-ddp-run reads whether any rank initialised)
DESTROY_POLL = 0.5  # seconds between checks for exited peers in destroy_process_group
MAX_TIMEOUT = 30 * 86400.0  # seconds; beyond it waits overflow (threading.TIMEOUT_MAX ~ 9.2e9)


@dataclass
class _World:
    env: DistEnv
    store: Any
    group: ProcessGroup
    owns_store: bool
    keys: Any  # this world's namespace in the store
    new_groups: Any = None  # new_group calls so far (the same sequence on every rank)
    by_key: dict = field(default_factory=dict)  # members_group's groups, by their members' key

    def __post_init__(self) -> None:
        self.new_groups = itertools.count(1)


_world: Optional[_World] = None
_exit_notice = False  # the excepthook that tells the peers is installed


def _pick_backend(backend: Optional[str]) -> str:
    name = backend_name(backend)
    if name is not None:
        return name
    from nccl_ddp.comm import nccl

    choice = "nccl" if nccl.is_available() else "host"
    log.info(
        "nccl_ddp: backend %r (%s)",
        choice,
        "CuPy sees a GPU and NCCL" if choice == "nccl" else "no usable GPU/NCCL",
    )
    return choice


def _create_group(backend: str, store: Any, env: DistEnv, timeout: float) -> ProcessGroup:
    ranks = list(range(env.world_size))
    if backend == "nccl":
        from nccl_ddp.comm.nccl.backend import NcclProcessGroup

        # the GPU DDP's device picks too: the local rank, or 0 when each process sees one GPU
        device_id = cast(CudaDevice, get_device("cuda", env.local_rank)).device_id
        return NcclProcessGroup.create(
            store, env.rank, env.world_size, ranks, timeout, "world", device_id=device_id
        )
    from nccl_ddp.comm.host.backend import HostProcessGroup

    world = f"world size {env.world_size} from {env.world_from}" if env.world_from else ""
    return HostProcessGroup.create(store, env.rank, env.world_size, ranks, timeout, "world", origin=world)


def init_process_group(
    backend: Optional[str] = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    store: Any = None,
) -> ProcessGroup:
    """Join the job: resolve who this process is, connect the store (unless given) and build the
    world group. Collective over all ranks. Returns the world group."""
    global _world
    if _world is not None:
        raise ConfigError(
            f"rank {_world.env.rank}: init_process_group called twice; call destroy_process_group() first"
        )
    check_timeout(timeout, "init_process_group")
    if store is not None and not all(hasattr(store, m) for m in ("get", "set", "add", "wait")):
        raise ConfigTypeError(
            f"init_process_group: store must be a key-value store (nccl_ddp.store."
            f"TCPStore) or None (connect to MASTER_ADDR:MASTER_PORT), got "
            f"{type(store).__name__}"
        )
    owns = store is None
    env = _beside_torch(rank, world_size) if owns else None
    if env is None:
        env = resolve_env(rank=rank, world_size=world_size)
    _leave_if_ms_scheduler(env)
    _notice_job_of_one(env)
    install_failure_hook()
    _install_exit_notice()
    name = _pick_backend(backend)
    if owns:
        from nccl_ddp.store.client import connect_store

        store = connect_store(env, timeout)
    from nccl_ddp.store.client import PrefixStore

    keys = PrefixStore(store, f"{INIT_KEYS}{next(_inits)}")
    try:
        group = _create_group(name, keys, env, timeout)
    except BaseException:
        if owns:
            store.close()
        raise
    _world = _World(env, store, group, owns, PrefixStore(keys, "api"))
    log.debug("rank %d/%d: %s world group ready", env.rank, env.world_size, name)
    return group


def _beside_torch(rank: Optional[int], world_size: Optional[int]) -> Optional[DistEnv]:
    """torch.distributed already up with these ranks (mp.spawn recipes, Ray Train, Lightning,
    Accelerate, any script that called dist.init_process_group first, with any init method or
    store): our store's address, port and secret come from rank 0 through torch.distributed
    (adapters/torch/dist.py), never from a variable the user did not set. None: torch is not up,
    or not with our world. Collective over torch's world."""
    if "torch.distributed" not in sys.modules:
        return None
    from nccl_ddp.arrays.frameworks import adapter_module

    return cast(Optional[DistEnv], adapter_module("torch.dist", "torch").env_beside_torch(rank, world_size))


def _leave_if_ms_scheduler(env: DistEnv) -> None:
    """msrun runs the script a third time as MindSpore's scheduler (MS_ROLE=MS_SCHED): that
    process is no training rank. Exit it, as MindSpore's own init() does for that role."""
    if env.ms_scheduler:
        log.info(
            "nccl_ddp: this is msrun's scheduler process (MS_ROLE=MS_SCHED), not a training "
            "rank: exiting, as mindspore.communication.init() does in this role"
        )
        raise SystemExit(0)


_noticed_alone = False


def _notice_job_of_one(env: DistEnv) -> None:
    """A plain `python train.py`: say once per process that it is a job of one, and why."""
    global _noticed_alone
    if env.source != "none" or _noticed_alone:
        return
    _noticed_alone = True
    log.warning(
        "nccl_ddp: no launcher or scheduler variables found (RANK/WORLD_SIZE, RANK_ID/"
        "MS_WORKER_NUM, SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMI_RANK): this job has one "
        "rank; start N with `nccl-ddp-run --nproc-per-node=N script.py`"
    )


def check_timeout(timeout: Any, where: str) -> None:
    """A timeout in seconds, > 0 and at most MAX_TIMEOUT; ConfigError naming `where` otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ConfigTypeError(
            f"{where}: timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not 0 < float(timeout) <= MAX_TIMEOUT:
        raise ConfigError(
            f"{where}: timeout must be a finite number of seconds > 0 and at most "
            f"{MAX_TIMEOUT:.0f} (30 days; every wait is bounded), got {timeout}"
        )


def destroy_process_group() -> None:
    """Shut the world group down and close the store (rank 0 last). No-op if not initialized.

    When rank 0 hosts the store, the ranks first wait for each other (so that nobody loses the
    store early), but never for a rank that is gone: not after a failed collective (a peer died),
    and not once the group sees a member's connection closed (it exited without destroying)."""
    global _world
    leaving = sys.exc_info()[1]  # called in a finally or except block: say why this rank leaves
    if leaving is not None:
        _tell_peers(leaving, "left the job (destroy_process_group) while handling")
    w, _world = _world, None
    if w is None:
        return
    try:
        if w.owns_store and w.env.world_size > 1 and not w.env.store_hosted_externally:
            _wait_for_peers(w)
    finally:
        for sub in w.by_key.values():
            sub.shutdown()
        w.group.shutdown()
        if w.owns_store:
            w.store.close()


def _tell_peers(exc: BaseException, how: str) -> None:
    """Poison this rank's live groups with why it leaves, so that a peer waiting on it fails
    naming this rank and `exc` instead of "peer closed the connection"."""
    w = _world
    if w is None or w.env.world_size == 1:
        return
    reason = f"rank {w.env.rank} {how} {type(exc).__name__}: {exc}"
    for g in [w.group, *w.by_key.values()]:
        if not g.failed:
            g.poison(reason)


def _install_exit_notice() -> None:
    """Once per process: an uncaught exception tells the peers (sys.excepthook runs before the
    interpreter closes the sockets)."""
    global _exit_notice
    if _exit_notice:
        return
    _exit_notice = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            _tell_peers(value, "exited on an uncaught")
        finally:
            previous(tp, value, tb)

    sys.excepthook = hook


def _wait_for_peers(w: _World) -> None:
    """The destroy barrier, in slices: between them, stop waiting if the group lost a peer."""
    if w.group.failed:
        log.warning(
            "rank %d: destroy_process_group after a failed collective on the world "
            "group: closing without waiting for the other ranks",
            w.env.rank,
        )
        return
    deadline = time.monotonic() + min(w.group.timeout, 30.0)
    while True:
        try:
            w.store.barrier("nccl_ddp/destroy", w.env.world_size, DESTROY_POLL)
            return
        except StoreTimeout as e:
            lost = w.group.lost_peers()
            if lost or time.monotonic() > deadline:
                log.warning(
                    "rank %d: destroy_process_group: not every rank arrived (%s); closing without them",
                    w.env.rank,
                    f"ranks {lost} exited" if lost else e,
                )
                return
        except NcclDdpError as e:
            log.warning("rank %d: destroy_process_group: not every rank arrived (%s)", w.env.rank, e)
            return


def is_initialized() -> bool:
    return _world is not None


def require_world(what: str) -> _World:
    """The world this process joined; ConfigError naming `what` before init_process_group."""
    if _world is None:
        raise ConfigError(
            f"{what} called before init_process_group(); call "
            f"nccl_ddp.init_process_group() first (it reads RANK/WORLD_SIZE/"
            f"MASTER_ADDR/MASTER_PORT, as set by nccl-ddp-run)"
        )
    return _world


def get_rank() -> int:
    return require_world("get_rank").env.rank


def get_world_size() -> int:
    return require_world("get_world_size").env.world_size


def get_local_rank() -> int:
    return require_world("get_local_rank").env.local_rank


def get_local_world_size() -> int:
    """The number of ranks on this node (the launcher's LOCAL_WORLD_SIZE or equivalent)."""
    return require_world("get_local_world_size").env.local_world_size


def get_store() -> Any:
    """The job's key-value store (coordination beside the collectives, e.g. Join's error report)."""
    return require_world("get_store").store


def get_world_group() -> ProcessGroup:
    return require_world("get_world_group").group


def new_group(ranks: Sequence[int]) -> Union[ProcessGroup, NonMemberGroup]:
    """A group of the given global ranks; every rank of the world must call it, in the same
    order. Non-members get a falsy `NonMemberGroup` that refuses to be used."""
    w = require_world("new_group")
    if isinstance(ranks, (str, bytes, dict)) or not hasattr(ranks, "__iter__"):
        raise ConfigTypeError(
            f"rank {w.env.rank}: new_group: ranks must be a list of global ranks "
            f"(ints), got {type(ranks).__name__} {ranks!r}"
        )
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
    if bad:
        raise ConfigTypeError(
            f"rank {w.env.rank}: new_group: ranks must be ints, got {bad!r} in {list(ranks)!r}"
        )
    if len(set(int(r) for r in ranks)) != len(ranks):
        raise ConfigError(
            f"rank {w.env.rank}: new_group: ranks {list(ranks)} list a rank more "
            f"than once; pass each member once"
        )
    ranks = [int(r) for r in ranks]
    _agree_on_members(w, ranks)
    group = w.group.new_subgroup(ranks)
    return NonMemberGroup(ranks, w.env.rank) if group is None else group


def members_group(ranks: Sequence[int], key: str) -> ProcessGroup:
    """A group of the given global ranks built by its members alone (ranks outside it never
    call this), for a group the members already agree on by `key` (a torch.distributed group's
    name: torch's own new_group was collective). The same key and ranks give the same group
    again; it is shut down with the world. Collective over the members."""
    w = require_world("members_group")
    members = sorted(int(r) for r in ranks)
    me = w.env.rank
    if me not in members or len(set(members)) != len(members) or members[-1] >= w.env.world_size:
        raise ConfigError(
            f"rank {me}: a group of ranks {list(ranks)} for this rank of a world of "
            f"{w.env.world_size}: its ranks must be distinct ranks of the world, this one among them"
        )
    tag = f"{key}/{'-'.join(map(str, members))}"  # ranks that disagree never share keys
    if tag in w.by_key:
        return cast(ProcessGroup, w.by_key[tag])
    from nccl_ddp.store.client import PrefixStore

    store, rank, size = PrefixStore(w.keys, f"members/{tag}"), members.index(me), len(members)
    name = f"group{members}".replace(" ", "")
    group: ProcessGroup
    if w.group.backend == "nccl":
        from nccl_ddp.comm.nccl.backend import NcclProcessGroup

        device_id = cast(Any, w.group).device_id
        group = NcclProcessGroup.create(
            store, rank, size, members, w.group.timeout, name, device_id=device_id
        )
    else:
        from nccl_ddp.comm.host.backend import HostProcessGroup

        group = HostProcessGroup.create(store, rank, size, members, w.group.timeout, name)
    w.by_key[tag] = group
    return group


def _agree_on_members(w: _World, ranks: list) -> None:
    """Every rank publishes the list it passed to this new_group call (the n-th on every rank);
    a member reads its fellow members' lists and raises `RankMismatchError` naming both lists
    if one differs: groups built from different lists would reduce the wrong ranks' data."""
    n, me = next(w.new_groups), w.env.rank
    keys = w.keys
    keys.set(f"new_group{n}/{me}", json.dumps(ranks))
    if me not in ranks:
        return
    timeout = w.group.timeout
    for r in ranks:
        try:
            theirs = json.loads(keys.get(f"new_group{n}/{r}", timeout=timeout))
        except StoreTimeout as e:
            raise CommTimeout(
                f"rank {me}: new_group({ranks}) (call #{n}): rank {r} did not call "
                f"new_group within {timeout:g}s; every rank of the world must call "
                f"new_group, in the same order"
            ) from e
        if theirs != ranks:
            raise RankMismatchError(
                f"rank {me}: new_group call #{n}: this rank passed ranks {ranks} but rank {r} "
                f"passed {theirs}; every rank must call new_group with the same ranks (in the "
                f"same order), or the groups would reduce the wrong ranks' data"
            )


def resolve_group(group: Optional[ProcessGroup], argname: str) -> ProcessGroup:
    """`group`, or the world group when None (the process group must be initialised)."""
    if group is None:
        return get_world_group()
    if isinstance(group, NonMemberGroup):
        raise group.refuse(f"{argname}")
    if not isinstance(group, ProcessGroup) and "torch.distributed" in sys.modules:
        from nccl_ddp.arrays.frameworks import adapter_module

        # a torch.distributed group: ours over the same ranks (adapters/torch/groups.py)
        group = adapter_module("torch.groups", "torch").ours_for(group, argname) or group
    if not isinstance(group, ProcessGroup):
        raise ConfigTypeError(
            f"{argname} must be a ProcessGroup from nccl_ddp.new_group(...) or None "
            f"(the world), got {type(group).__name__} {group!r}"
        )
    return group


def device_of(group: ProcessGroup) -> Device:
    """The device whose arrays `group` reduces: host (NumPy) or cuda (CuPy)."""
    return get_device("host" if group.backend == "host" else "cuda", getattr(group, "device_id", None))
