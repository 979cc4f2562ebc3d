"""Our process group beside a torch.distributed that is already up (Lightning, Accelerate,
mp.spawn recipes, Ray Train, any script that called `dist.init_process_group` first).

torch's store holds MASTER_PORT (or torch started from a file:// or a store= of its own, and no
MASTER_PORT is set at all), so `nd.init_process_group()` asks here first (`env_beside_torch`,
from comm/api.py): when torch's world has our ranks, rank 0 picks a free port for our store and a
job secret and every rank receives them through torch.distributed (rank 0's NCCL_DDP_STORE_PORT /
NCCL_DDP_SECRET are kept when set, as under nccl-ddp-run). Our DDP and
ZeroRedundancyOptimizer built while torch.distributed is up and ours is not join ours the same way
(`join_torch_world`), so torch's recipes change only their import.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import socket
from typing import Any, Optional

import torch.distributed as dist

from nccl_ddp.comm import api
from nccl_ddp.comm.backends import backend_name
from nccl_ddp.errors import ConfigError
from nccl_ddp.job.env import DEFAULT_TIMEOUT, LOOPBACK, DistEnv, launcher_ranks, resolve_env

log = logging.getLogger(__name__)


def init_beside_torch(backend: str, rank: int, world_size: int, timeout: float, who: str) -> bool:
    """Initialise our world group as `rank` of `world_size` unless it is already (then check it
    matches). Returns whether this call created it (the caller destroys what it created).
    Collective over torch.distributed's world."""
    if api.is_initialized():
        have = (api.get_rank(), api.get_world_size())
        if have != (rank, world_size):
            raise ConfigError(
                f"nccl_ddp is initialised as rank {have[0]} of {have[1]}, but "
                f"{who} made this process rank {rank} of {world_size}"
            )
        return False
    api.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return True


def env_beside_torch(rank: Optional[int], world_size: Optional[int]) -> Optional[DistEnv]:
    """Our DistEnv when torch.distributed is up with our world: rank 0's store address, port and
    secret, received through torch.distributed, whatever torch's init method or store (env://,
    file://, tcp://, store=FileStore/TCPStore): nothing in the environment is needed. None when
    torch is not up, or its world is not ours (then the environment decides, as without torch).
    No launcher variables and no ranks given (an mp.spawn recipe passes its ranks to
    dist.init_process_group only): torch's ranks are ours. Collective over torch's world (every
    rank decides alike: the world sizes and the gathered ranks are the same everywhere)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    source, e_rank, e_world = launcher_ranks()
    take_ranks = rank is None and world_size is None and source == "none"
    world = dist.get_world_size() if take_ranks else world_size if world_size is not None else e_world
    if world is None or world < 2 or dist.get_world_size() != world:
        return None
    me = dist.get_rank() if take_ranks else rank if rank is not None else e_rank
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (me, socket.gethostname(), _proposal() if me == 0 else None))
    ranks = [r for r, _, _ in everyone]
    if ranks != list(range(world)):
        log.warning(
            "rank %s: torch.distributed is up with %d ranks, but nccl_ddp's ranks in torch's "
            "order are %s: nccl_ddp rendezvous through MASTER_ADDR/MASTER_PORT instead (pass "
            "rank=dist.get_rank() to nccl_ddp.init_process_group to share torch's ranks)",
            me,
            world,
            ranks,
        )
        return None
    addr, port, secret = everyone[0][2]
    if addr is None:  # no MASTER_ADDR on rank 0: loopback on one node, else rank 0's host name
        one_host = len({host for _, host, _ in everyone}) == 1
        addr = LOOPBACK if one_host else everyone[0][1]
    master_port = None if os.environ.get("MASTER_PORT", "").strip() else port
    if take_ranks:
        rank, world_size = me, world
    env = resolve_env(rank=rank, world_size=world_size, master_addr=addr, master_port=master_port)
    return dataclasses.replace(env, store_port=port, secret=secret)


def _proposal() -> tuple:
    """Rank 0's (MASTER_ADDR or None, our store's port, the job secret): its NCCL_DDP_STORE_PORT
    and NCCL_DDP_SECRET when set (as under nccl-ddp-run), else a free port and a fresh secret."""
    addr = os.environ.get("MASTER_ADDR", "").strip() or None
    port = os.environ.get("NCCL_DDP_STORE_PORT", "").strip()
    return (
        addr,
        int(port) if port.isdigit() else _free_port(addr or "0.0.0.0"),
        os.environ.get("NCCL_DDP_SECRET") or secrets.token_hex(16),
    )


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def runs_natively(backend: str) -> bool:
    """Whether a torch group of `backend` maps onto a group of ours ("gloo" -> host, "nccl")."""
    try:
        backend_name(backend)
    except ConfigError:
        return False
    return True


def join_torch_world(group: Any, who: str) -> Any:
    """`group`, after joining our world beside torch's when `group` is None (the world) or a
    torch group, ours is not initialised and torch.distributed is: then our DDP /
    ZeroRedundancyOptimizer / grad reducer in a torch script need no
    `nccl_ddp.init_process_group()` of their own. Our group takes torch's ranks and backend
    (gloo -> host, nccl -> nccl) and is destroyed at exit. A torch group of another backend
    joins nothing: torch carries ours over it (groups.py)."""
    torch_up = dist.is_available() and dist.is_initialized()
    ours_or_none = group is None or isinstance(group, dist.ProcessGroup)
    if not ours_or_none or api.is_initialized() or not torch_up:
        return group
    backend = str(dist.get_backend())
    if not runs_natively(backend):  # torch's "threaded", "mpi", ...: groups.ours_for carries it
        if group is None:
            raise ConfigError(
                f"rank {dist.get_rank()}: {who}: torch.distributed runs backend {backend!r}, "
                "which nccl_ddp does not run itself: pass torch's group (process_group="
                "torch.distributed.group.WORLD, or group= for the grad reducer), whose "
                "collectives then carry ours"
            )
        return group
    log.info(
        "rank %d: %s joins nccl_ddp's process group beside torch.distributed's (%s, %d ranks)",
        dist.get_rank(),
        who,
        backend,
        dist.get_world_size(),
    )
    init_beside_torch(backend, dist.get_rank(), dist.get_world_size(), DEFAULT_TIMEOUT, who)
    atexit.register(api.destroy_process_group)
    return group
