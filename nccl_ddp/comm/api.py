"""The torch.distributed-like functional API: one world group per process, collectives on any
DLPack array (converted by `nccl_ddp.dlpack`).

    nd.init_process_group()                  # env from nccl-ddp-run / torchrun / Slurm / MPI
    nd.all_reduce(grad, op="avg")            # in place on NumPy / torch CPU / CuPy arrays
    w = nd.all_reduce(x, async_op=True); ...; x = w.result()
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union, cast

import numpy as np

from nccl_ddp import dlpack
from nccl_ddp.comm.backends import backend_name
from nccl_ddp.comm.group import NonMemberGroup, ProcessGroup, ReduceOp, Work
from nccl_ddp.device import CudaDevice, Device, HostDevice, get_device
from nccl_ddp.env import DEFAULT_TIMEOUT, DistEnv, install_failure_hook, resolve_env
from nccl_ddp.errors import (
    CommTimeout,
    ConfigError,
    ConfigTypeError,
    NcclDdpError,
    RankMismatchError,
    StoreTimeout,
)
from nccl_ddp.validate import check_bool

log = logging.getLogger(__name__)

_DEVICE_KIND = {"host": "host", "nccl": "cuda"}
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

    def __post_init__(self) -> None:
        self.new_groups = itertools.count(1)


_world: Optional[_World] = None
_IMMEDIATE = HostDevice().current_stream()


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
    _check_timeout(timeout, "init_process_group")
    if store is not None and not all(hasattr(store, m) for m in ("get", "set", "add", "wait")):
        raise ConfigTypeError(
            f"init_process_group: store must be a key-value store (nccl_ddp.store."
            f"TCPStore) or None (connect to MASTER_ADDR:MASTER_PORT), got "
            f"{type(store).__name__}"
        )
    env = resolve_env(rank=rank, world_size=world_size)
    _leave_if_ms_scheduler(env)
    owns = store is None
    if owns:
        env = _beside_torch(env, rank is None and world_size is None and env.source == "none")
    _notice_job_of_one(env)
    install_failure_hook()
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


def _beside_torch(env: DistEnv, take_ranks: bool) -> DistEnv:
    """torch.distributed already up with these ranks (mp.spawn recipes, Ray Train, Lightning,
    Accelerate, any script that called dist.init_process_group first): its store holds
    MASTER_PORT, so ours listens on a port rank 0 picks, with a secret rank 0 makes, both sent
    through torch.distributed (adapters/torch_dist.py); with `take_ranks` (no launcher named
    this process's rank) torch's ranks are ours. Collective over torch's world."""
    if "torch.distributed" not in sys.modules:
        return env
    from nccl_ddp.frameworks import adapter_module

    return cast(DistEnv, adapter_module("torch_dist", "torch").store_beside_torch(env, take_ranks))


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


def _check_timeout(timeout: Any, where: str) -> None:
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
    w, _world = _world, None
    if w is None:
        return
    try:
        if w.owns_store and w.env.world_size > 1 and not w.env.store_hosted_externally:
            _wait_for_peers(w)
    finally:
        w.group.shutdown()
        if w.owns_store:
            w.store.close()


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


def _require(what: str) -> _World:
    if _world is None:
        raise ConfigError(
            f"{what} called before init_process_group(); call "
            f"nccl_ddp.init_process_group() first (it reads RANK/WORLD_SIZE/"
            f"MASTER_ADDR/MASTER_PORT, as set by nccl-ddp-run)"
        )
    return _world


def get_rank() -> int:
    return _require("get_rank").env.rank


def get_world_size() -> int:
    return _require("get_world_size").env.world_size


def get_local_rank() -> int:
    return _require("get_local_rank").env.local_rank


def get_local_world_size() -> int:
    """The number of ranks on this node (the launcher's LOCAL_WORLD_SIZE or equivalent)."""
    return _require("get_local_world_size").env.local_world_size


def get_store() -> Any:
    """The job's key-value store (coordination beside the collectives, e.g. Join's error report)."""
    return _require("get_store").store


def get_world_group() -> ProcessGroup:
    return _require("get_world_group").group


def new_group(ranks: Sequence[int]) -> Union[ProcessGroup, NonMemberGroup]:
    """A group of the given global ranks; every rank of the world must call it, in the same
    order. Non-members get a falsy `NonMemberGroup` that refuses to be used."""
    w = _require("new_group")
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
    if not isinstance(group, ProcessGroup):
        raise ConfigTypeError(
            f"{argname} must be a ProcessGroup from nccl_ddp.new_group(...) or None "
            f"(the world), got {type(group).__name__} {group!r}"
        )
    return group


def device_of(group: ProcessGroup) -> Device:
    """The device whose arrays `group` reduces: host (NumPy) or cuda (CuPy)."""
    return get_device("host" if group.backend == "host" else "cuda", getattr(group, "device_id", None))


# -- collectives --------------------------------------------------------------------------------


class ApiWork(Work):
    """A backend Work plus the step that turns its native output into the caller's object."""

    def __init__(self, inner: Work, finish: Callable[[], Any]) -> None:
        self._inner, self._finish = inner, finish
        self._done, self._value = False, None

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is not None:
            _check_timeout(timeout, "Work.wait")
        self._inner.wait(timeout)
        if not self._done:
            self._value, self._done = self._finish(), True
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def result(self) -> Any:
        self.wait()
        return self._value


class _Buf:
    """One caller array as a contiguous native buffer; `finish()` writes back and returns what
    the caller gets."""

    def __init__(self, x: Any, kind: str, where: str) -> None:
        self.x = x
        self.native = dlpack.to_native(x, kind, where)
        contiguous = self.native.flags.c_contiguous
        self.buf = self.native if contiguous else self.native.copy()  # copy() is C order

    def finish(self) -> Any:
        if self.buf is not self.native:
            self.native[...] = self.buf
        return dlpack.from_native(self.native, self.x)


def _context(group: Optional[ProcessGroup], what: str, async_op: bool) -> tuple:
    """(group, device kind, error prefix, stream to pass) for one API call."""
    w = _require(what)
    check_bool("async_op", async_op)
    g = w.group if group is None else group
    if isinstance(g, NonMemberGroup):
        raise g.refuse(what)
    if not isinstance(g, ProcessGroup):
        raise ConfigError(
            f"rank {w.env.rank}: {what}: group must be a ProcessGroup from "
            f"new_group() (or None for the world), got {type(g).__name__}"
        )
    # synchronous host calls pass the caller's immediate stream: the op may then run on the
    # calling thread, saving two thread switches
    stream = _IMMEDIATE if g.backend == "host" and not async_op else None
    return g, _DEVICE_KIND[g.backend], f"rank {w.env.rank}: {what} on group {g.name!r}", stream


def _run(work: Work, finish: Callable[[], Any], async_op: bool) -> Any:
    w = ApiWork(work, finish)
    if async_op:
        return w
    return w.result()


def all_reduce(
    x: Any, op: ReduceOp | str = "sum", group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Any:
    """Reduce `x` over the group (in place where possible); returns `x` or the new array.

    op: sum, avg, max, min, prod. avg on integer dtypes sums in the dtype (wrapping like NCCL)
    and truncates toward zero; bool supports max (any) and min (all) only."""
    g, kind, where, stream = _context(group, "all_reduce", async_op)
    with g.checking("all_reduce"):  # refused here only: the group is poisoned
        b = _Buf(x, kind, where)
        return _run(g.all_reduce(b.buf, ReduceOp.parse(op), stream), b.finish, async_op)


def broadcast(x: Any, src: int = 0, group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Copy global rank `src`'s `x` to every member of the group."""
    g, kind, where, stream = _context(group, "broadcast", async_op)
    with g.checking("broadcast"):  # refused here only: the group is poisoned
        if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
            raise ConfigTypeError(
                f"{where}: src must be an int (a global rank), got {type(src).__name__} {src!r}"
            )
        if src not in g.ranks:
            raise ConfigError(
                f"{where}: src rank {src} is not a member of the group {list(g.ranks)}; src is a global rank"
            )
        b = _Buf(x, kind, where)
        return _run(g.broadcast(b.buf, g.ranks.index(src), stream), b.finish, async_op)


def _gather_parts(parts: Sequence[Any], g: ProcessGroup, kind: str, where: str, size: int, role: str) -> list:
    if len(parts) != g.size:
        raise ConfigError(
            f"{where}: {role} has {len(parts)} arrays but the group has {g.size} ranks; pass one per rank"
        )
    bufs = [_Buf(p, kind, where) for p in parts]
    for i, b in enumerate(bufs):
        if b.buf.size != size:
            raise ConfigError(f"{where}: {role}[{i}] has {b.buf.size} elements, expected {size}")
    return bufs


def all_gather(out: Any, x: Any, group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """`out` (a list of group-size arrays, or one array of group size x `x.size` elements)
    receives every member's `x`, in group-rank order. Returns `out` (or new arrays)."""
    g, kind, where, stream = _context(group, "all_gather", async_op)
    with g.checking("all_gather"):  # refused here only: the group is poisoned
        xi = _Buf(x, kind, where)
        if isinstance(out, (list, tuple)):
            parts = _gather_parts(out, g, kind, where, xi.buf.size, "out")
            flat = _empty_like(xi.buf, g.size * xi.buf.size)

            def finish() -> Any:
                res = []
                for i, p in enumerate(parts):
                    p.buf.reshape(-1)[...] = flat[i * xi.buf.size : (i + 1) * xi.buf.size]
                    res.append(p.finish())
                return type(out)(res) if isinstance(out, tuple) else _same_list(out, res)

            return _run(g.all_gather(flat, xi.buf.reshape(-1), stream), finish, async_op)
        o = _Buf(out, kind, where)
        return _run(g.all_gather(o.buf.reshape(-1), xi.buf.reshape(-1), stream), o.finish, async_op)


def reduce_scatter(
    out: Any,
    inputs: Any,
    op: ReduceOp | str = "sum",
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Any:
    """`inputs` (a list of group-size arrays, or one array of group size x `out.size`) is reduced
    over the group; member i receives part i in `out`. Returns `out` (or a new array)."""
    g, kind, where, stream = _context(group, "reduce_scatter", async_op)
    with g.checking("reduce_scatter"):  # refused here only: the group is poisoned
        o = _Buf(out, kind, where)
        if isinstance(inputs, (list, tuple)):
            parts = _gather_parts(inputs, g, kind, where, o.buf.size, "inputs")
            flat = _empty_like(o.buf, g.size * o.buf.size)
            for i, p in enumerate(parts):
                flat[i * o.buf.size : (i + 1) * o.buf.size] = p.buf.reshape(-1)
        else:
            flat = _Buf(inputs, kind, where).buf.reshape(-1)
        work = g.reduce_scatter(o.buf.reshape(-1), flat, ReduceOp.parse(op), stream)
        return _run(work, o.finish, async_op)


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Returns once every member of the group reached the barrier (a Work with async_op)."""
    g, _, _, stream = _context(group, "barrier", async_op)
    return _run(g.barrier(stream), lambda: None, async_op)


def _empty_like(a: Any, n: int) -> Any:
    if isinstance(a, np.ndarray):
        return np.empty(n, a.dtype)
    import cupy

    return cupy.empty(n, a.dtype)


def _same_list(out: list, res: list) -> list:
    """The caller's list, updated where a framework array could not be written in place."""
    for i, r in enumerate(res):
        if r is not out[i]:
            out[i] = r
    return out
