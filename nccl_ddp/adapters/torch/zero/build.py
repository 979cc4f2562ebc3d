"""How `ZeroRedundancyOptimizer` is put together: the stage and the shard core it steps, chosen by
the model (adapters/torch/zero/optimizer.py).

Parameters of an `nccl_ddp.DistributedDataParallel` built with `zero=ZeroConfig(...)` carry the
wrapper's mark (adapters/torch/adapter.py `owner_of`), and through it the model's shard core: the stage,
`overlap_param_gather` and `reduce_dtype` are that core's. Any other parameters get a ZeRO-1 core
of the optimizer's own, over grads all-reduced whole. The inner torch optimizer steps one tensor per
(parameter, shard) piece, grouped as the parameters are.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from nccl_ddp.adapters.torch.adapter import owner_of
from nccl_ddp.adapters.torch.sparse import refuse_in_optimizer
from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.config import ZeroConfig
from nccl_ddp.zero.core import build_core


def pick_stage(trainable: List[Any], zero_stage: Optional[int], group: Any) -> Tuple[int, Any]:
    """(stage, the TorchModule of the sharded model or None). The model decides: its
    parameters carry the wrapper's mark, and a wrapper built with zero= holds the core.
    `zero_stage`: the optimizer's argument; `group`: its process group."""
    refuse_in_optimizer(trainable, group.rank, "ZeroRedundancyOptimizer")
    owners = [owner_of(p) for p in trainable]
    sharded = {id(o): o for o in owners if o is not None and o.shard_core is not None}
    if not sharded:
        if zero_stage == 2:
            raise ConfigError(
                "zero_stage=2 needs the parameters of a model built for ZeRO-2: wrap it as "
                "nccl_ddp.DistributedDataParallel(module, zero=nccl_ddp.ZeroConfig(stage=2)) "
                "(the reduce-scatter is part of the model, chosen when it is built) and pass "
                "model.parameters(); or drop zero_stage for ZeRO-1 (grads all-reduced whole)"
            )
        return 1, None
    owner = next(iter(sharded.values()))
    stray = [i for i, o in enumerate(owners) if o is not owner]
    if len(sharded) > 1 or stray:
        raise ConfigError(
            f"trainable parameters {stray[:10]} (by position in the param groups, frozen ones "
            "left out) do not belong to the sharded model (zero=) the others belong to; pass "
            "that model's parameters (model.parameters()) alone"
        )
    held = {id(p) for p in trainable}
    missing = [n for n, p in zip(owner.names, owner.params) if id(p) not in held]
    if missing:
        raise ConfigError(
            "the optimizer must hold every trainable parameter of the sharded model (its "
            f"shards cut all of them); missing {missing[:10]}. Pass model.parameters()"
        )
    stage = 1 if owner.shard_core is None else owner.shard_core.stage  # (never None: owners in `sharded`)
    if zero_stage is not None and zero_stage != stage:
        raise ConfigError(
            f"zero_stage={zero_stage}, but the model was built with "
            f"zero=ZeroConfig(stage={stage}); the model decides the stage: build it with "
            f"zero=nccl_ddp.ZeroConfig(stage={zero_stage}), or drop zero_stage"
        )
    if owner.group is not group:
        raise ConfigError(
            "ZeRO: the optimizer's process_group differs from the "
            "DistributedDataParallel model's; pass the same group (or None)"
        )
    return stage, owner


def adopt_options(opt: Any, asked: Dict[str, Any], model: Optional[ZeroConfig]) -> None:
    """overlap_param_gather and reduce_dtype are the model's ZeroConfig's (ZeRO-2), set on the
    optimizer `opt`; `asked` (given to the optimizer) must agree with it. ZeRO-1 has neither."""
    for name, value in asked.items():
        if model is not None and model.stage == 2:
            have = getattr(model, name)
            if value is not None and value != have:
                raise ConfigError(
                    f"{name}={value} differs from the model's zero=ZeroConfig({name}={have}); "
                    f"ZeRO-2 options are the model's: build it with ZeroConfig({name}=...) and "
                    "leave it unset here"
                )
            setattr(opt, name, have)
        elif value not in (None, False):
            raise ConfigError(
                f"{name}={value} needs ZeRO-2 (a model built with "
                f"nccl_ddp.DistributedDataParallel(module, zero=nccl_ddp.ZeroConfig(stage=2, "
                f"{name}=...))); under ZeRO-1 the grads arrive all-reduced and step() gathers "
                "the parameters before it returns"
            )


def own_core(trainable: List[Any], group: Any, device: Any) -> Tuple[List[Any], List[Any], Any]:
    """ZeRO-1 over grads all-reduced by anyone: (layout order, names, a shard core of the
    optimizer's own over `trainable`). A parameter of our DDP without zero= is moved into the
    core's flat buffer by its reducer (which moves `p.data`); any other gets `p.data` set."""
    order = trainable
    names = [f"{i} (shape {tuple(p.shape)})" for i, p in enumerate(trainable)]

    def install(i: int, view: Any) -> None:
        model = owner_of(order[i])
        if model is not None:  # our DDP without zero=: its reducer moves it (and p.data)
            model.param_moved(order[i], view)
        else:
            order[i].data = from_native(view)

    natives = [to_native(p) for p in order]
    core = build_core(ZeroConfig(stage=1), natives, group, device, install=install, fp32_grad_shards=False)
    return order, names, core


def piece_groups(
    param_groups: List[Dict[str, Any]], pieces: List[Any], piece_params: List[Any], order: List[Any]
) -> List[Dict[str, Any]]:
    """The inner optimizer's param groups: each of ours, its hyperparameters kept, over the
    pieces (`piece_params`, one per piece of this rank's shards) of its parameters."""
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    inner_groups = []
    for gi, g in enumerate(param_groups):
        ps = [t for pc, t in zip(pieces, piece_params) if group_of[id(order[pc.param])] == gi]
        inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
    return inner_groups
