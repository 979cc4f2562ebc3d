"""Horovod's torch helpers (horovod/torch/functions.py): broadcast_parameters,
broadcast_optimizer_state, and the object collectives."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple, Union

import torch

from nccl_ddp.adapters.torch.tensors import to_native
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.common import broadcast_object
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.torch.optimizer import _DistributedOptimizer

Params = Union[Dict[str, torch.Tensor], Iterable[Union[torch.Tensor, Tuple[str, torch.Tensor]]]]


def broadcast_parameters(
    params: Params, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """`root_rank`'s values into `params` on every rank: a `state_dict()`, `named_parameters()`
    or a list of tensors; fused into one broadcast per dtype."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ConfigTypeError(f"broadcast_parameters: invalid params of type {type(params).__name__}")
    tensors = []
    for name, p in items:
        if not torch.is_tensor(p):
            raise ConfigTypeError(
                f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, not a tensor"
            )
        tensors.append(to_native(p))
    collectives.broadcast_many_(tensors, root_rank, group_of(process_set, "broadcast_parameters"))


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: Optional[torch.nn.Module] = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """`root_rank`'s optimizer state (tensors fused per dtype; scalars and the param groups'
    options pickled) on every rank. A fresh optimizer's state is created first by one step on
    zero grads, as Horovod does."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError("broadcast_optimizer_state: cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        if isinstance(optimizer, _DistributedOptimizer):
            # the wrapped class's step: a DistributedOptimizer's would reduce the zero grads
            super(_DistributedOptimizer, optimizer).step()  # type: ignore[misc]
        else:
            optimizer.step()
    if not optimizer.state:
        return  # a stateless optimizer (plain SGD): nothing to broadcast
    state_dict = optimizer.state_dict()
    by_index = [p for g in optimizer.param_groups for p in g["params"]]
    tensors: list = []
    scalars: dict = {}
    for gi, group in enumerate(state_dict["param_groups"]):
        scalars[("group", gi)] = {k: v for k, v in group.items() if k != "params"}
    for pid in sorted(state_dict["state"]):
        for name, value in state_dict["state"][pid].items():
            if torch.is_tensor(value):
                tensors.append(optimizer.state[by_index[pid]][name])
            else:
                scalars[("state", pid, name)] = value
    broadcast_parameters(tensors, root_rank, process_set)
    received = broadcast_object(scalars, root_rank, process_set=process_set)
    assert isinstance(received, dict)
    for key, value in received.items():
        if key[0] == "group":
            optimizer.param_groups[key[1]].update(value)
        else:
            optimizer.state[by_index[key[1]]][key[2]] = value
