"""torch.distributed groups where ours go: `process_group=` of our DDP and ZeroRedundancyOptimizer,
`group=` of the grad reducer (comm/api.py `resolve_group` asks here for a group it does not know).

torch's world group (`dist.group.WORLD`, or any torch group of every rank) is our world group; a
subgroup (`dist.new_group(ranks)`, a data-parallel group of a Megatron-style script) is one of ours
over the same global ranks, built by its members alone and keyed by torch's group name (torch's
`new_group` was collective already, so ranks outside it never have to take part here). Our world
joins beside torch's first when it is not up yet (adapters/torch/dist.py). A group of a backend we
do not run (torch's "threaded" test world, "mpi", ...) gets a host group of ours whose collectives
torch carries (adapters/torch/carried.py), outside our world.
"""

from __future__ import annotations

from typing import Any, Optional

from nccl_ddp.comm import api
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigError


def is_torch_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def ours_for(group: Any, argname: str) -> Optional[ProcessGroup]:
    """Our group over `group`'s ranks when it is a torch.distributed group (None otherwise)."""
    if not is_torch_group(group):
        return None
    import torch.distributed as dist

    from nccl_ddp.adapters.torch.dist import join_torch_world, runs_natively

    backend = str(dist.get_backend(group))
    if not runs_natively(backend):  # torch's "threaded", "mpi", ...: torch carries ours
        from nccl_ddp.adapters.torch.carried import carried_group

        return carried_group(group, backend, argname)

    join_torch_world(group, argname)
    world = api.get_world_group()
    torch_where = (dist.get_rank(), dist.get_world_size())
    if torch_where != (world.rank, world.size):
        raise ConfigError(
            f"rank {world.rank}: {argname} is a torch.distributed group, but torch made this "
            f"process rank {torch_where[0]} of {torch_where[1]} and nccl_ddp rank {world.rank} "
            f"of {world.size}: map torch's groups onto ours with the same ranks (pass "
            "rank=dist.get_rank(), world_size=dist.get_world_size() to "
            "nccl_ddp.init_process_group), or pass nccl_ddp.new_group(ranks)"
        )
    ranks = dist.get_process_group_ranks(group)
    if world.rank not in ranks:
        raise ConfigError(
            f"rank {world.rank}: {argname} is a torch.distributed group of ranks {ranks}, "
            "which does not hold this rank; build the model on a group this rank belongs to"
        )
    if sorted(ranks) == list(range(world.size)):
        return world
    return api.members_group(ranks, f"torch/{group.group_name}")
