"""Join nccl_ddp's process group beside a torch.distributed that a library (Lightning,
Accelerate) has initialised: same ranks, and our store on a port rank 0 finds free (torch's store
holds MASTER_PORT) with a job secret, both sent to every rank through torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from typing import Dict, Iterator

from nccl_ddp.comm import api
from nccl_ddp.errors import ConfigError


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
    with _environ(_store_env(rank)):
        api.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return True


def _store_env(rank: int) -> Dict[str, str]:
    """NCCL_DDP_STORE_PORT and NCCL_DDP_SECRET from rank 0 (values already set are kept)."""
    import torch.distributed as dist

    mine: Dict[str, str] = {}
    if rank == 0:
        mine = {
            "NCCL_DDP_STORE_PORT": os.environ.get("NCCL_DDP_STORE_PORT") or str(_free_port()),
            "NCCL_DDP_SECRET": os.environ.get("NCCL_DDP_SECRET") or secrets.token_hex(16),
        }
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((os.environ.get("MASTER_ADDR", "127.0.0.1"), 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(values: Dict[str, str]) -> Iterator[None]:
    """os.environ with `values` for the block (our init reads its store from the environment)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
