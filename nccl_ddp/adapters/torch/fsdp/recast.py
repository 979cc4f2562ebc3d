"""A sharded module cast to another dtype after `fully_shard` (`model.to(torch.float64)`, as
FSDP2 allows): each unit whose parameters change dtype gets shards laid out for the new dtypes,
its parameters new `Shard(0)` DTensors over them holding the cast values of their old shards.
Collective (every rank casts alike: the new dtypes are compared first and named on every rank).
A change of device stays refused (`ShardedParam.check_apply`)."""

from __future__ import annotations

from typing import Any, Callable, List

import torch

from nccl_ddp.adapters.torch.fsdp.param import ShardedParam
from nccl_ddp.adapters.torch.fsdp.unit import Unit
from nccl_ddp.arrays.dlpack import numpy_dtype
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.param_sync import Subject, check_same_params
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.params import UnitShards, unit_layout

_CAST = Subject(
    "parameters of a sharded module cast after fully_shard",
    "parameter",
    "cast the module to the same dtype",
)


def new_dtypes(unit: Unit, fn: Callable[[Any], Any]) -> List[torch.dtype]:
    """The dtype `fn` (an `_apply`'s) gives each of the unit's parameters."""
    with torch.no_grad():
        return [fn(p.sharded).dtype for p in unit.params]


def recast(unit: Unit, dtypes: List[torch.dtype]) -> None:
    """`unit` (resharded) over new shards of `dtypes`; its parameters' values cast into them.
    Mixed precision keeps its compute dtype; without it the compute dtype is the new one."""
    old = unit.params
    if any(p.sharded.grad is not None for p in old):
        raise ConfigError(
            f"rank {unit.shards.rank}: the fully_shard unit {unit.name} has grads: cast the "
            "module before its first backward, or after optimizer.zero_grad(set_to_none=True)"
        )
    shards, group = unit.shards, unit.shards.group
    # the shards hold the compute dtype (fully_shard's layout): the new one, or the policy's
    computes = [d if p.compute_dtype == p.orig_dtype else p.compute_dtype for p, d in zip(old, dtypes)]
    cast = [ParamSpec(p.shape, numpy_dtype(d), name=p.fqn) for p, d in zip(old, dtypes)]
    check_same_params(cast, group, shards.device, owner="fully_shard", subject=_CAST)
    specs = [ParamSpec(p.shape, numpy_dtype(c), name=p.fqn) for p, c in zip(old, computes)]
    new_shards = UnitShards(
        unit_layout(specs, group.size, shards.device.align_bytes, shards.layout.dims),
        group,
        shards.device,
        shards.comm,
        shards.scratch,
        shards.name,
        replicate=shards.replicate,
        gathers=shards.gathers,
    )
    params = []
    for p, dtype, compute in zip(old, dtypes, computes):
        meta = torch.nn.Parameter(
            torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad
        )
        sp = ShardedParam(
            p.index, p.fqn, p.slots, meta, shards=new_shards, mesh=p.mesh, compute_dtype=compute, dim=p.dim
        )
        if not p.meta:
            with torch.no_grad():
                sp.adopt_local(p.sharded.to_local().to(dtype))
        for k, v in p.attrs.items():
            sp.tag(k, v)
        sp.register(unsharded=False)
        params.append(sp)
    unit.params, unit.shards = params, new_shards
