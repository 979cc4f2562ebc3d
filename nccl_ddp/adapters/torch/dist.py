"""Our process group beside a torch.distributed that is already up (Lightning, Accelerate,
mp.spawn recipes, Ray Train, any script that called `dist.init_process_group` first).

torch's store holds MASTER_PORT, so `nd.init_process_group()` asks here first
(`store_beside_torch`, from comm/api.py): when torch's world has our ranks, rank 0 picks a free
port for our store and a job secret and every rank receives them through torch.distributed (rank
0's NCCL_DDP_STORE_PORT / NCCL_DDP_SECRET are kept when set, as under nccl-ddp-run). Our DDP and
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
from typing import Any

import torch.distributed as dist

from nccl_ddp.comm import api
from nccl_ddp.env import DEFAULT_TIMEOUT, DistEnv, resolve_env
from nccl_ddp.errors import ConfigError

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


def store_beside_torch(env: DistEnv, take_ranks: bool) -> DistEnv:
    """`env` with the store port and secret rank 0 chose, when torch.distributed is up with the
    same world; else `env` unchanged. `take_ranks`: no launcher set this process's rank (an
    mp.spawn recipe passes it to dist.init_process_group only), so torch's ranks are ours.
    Collective over torch's world (every rank decides alike: the world sizes and the gathered
    ranks are the same everywhere)."""
    if not (dist.is_available() and dist.is_initialized()):
        return env
    world = dist.get_world_size() if take_ranks else env.world_size
    if world < 2 or dist.get_world_size() != world:
        return env
    rank = dist.get_rank() if take_ranks else env.rank
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rank, _proposal(env) if rank == 0 else None))
    ranks = [r for r, _ in everyone]
    if ranks != list(range(world)):
        log.warning(
            "rank %d: torch.distributed is up with %d ranks, but nccl_ddp's ranks in torch's "
            "order are %s: our store stays on port %d (pass rank=dist.get_rank() to "
            "nccl_ddp.init_process_group to share torch's ranks)",
            rank,
            world,
            ranks,
            env.store_port,
        )
        return env
    port, secret = everyone[0][1]
    if take_ranks:
        master_port = None if os.environ.get("MASTER_PORT", "").strip() else port
        env = resolve_env(rank=rank, world_size=world, master_port=master_port)
    return dataclasses.replace(env, store_port=port, secret=secret)


def _proposal(env: DistEnv) -> tuple:
    port = os.environ.get("NCCL_DDP_STORE_PORT", "").strip()
    return (
        int(port) if port.isdigit() else _free_port(env.master_addr),
        os.environ.get("NCCL_DDP_SECRET") or secrets.token_hex(16),
    )


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def join_torch_world(group: Any, who: str) -> Any:
    """`group`, after joining our world beside torch's when `group` is None (the world), ours is
    not initialised and torch.distributed is: then our DDP / ZeroRedundancyOptimizer in a torch
    script need no `nccl_ddp.init_process_group()` of their own. Our group takes torch's ranks
    and backend (gloo -> host, nccl -> nccl) and is destroyed at exit."""
    if group is not None or api.is_initialized() or not (dist.is_available() and dist.is_initialized()):
        return group
    backend = str(dist.get_backend())
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
