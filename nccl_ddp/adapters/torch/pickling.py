"""`torch.save(model)` / `torch.load` / `copy.deepcopy` of our torch DDP wrapper, as torch's DDP
pickles: what is tied to this process (the reducer and its buckets, the grad hooks, the group) is
left out, and rebuilt on load on the world group in force (joined beside torch.distributed when
ours is not up), with the comm hook registered again. Like torch's, only a wrapper on the world
group pickles, and loading runs no collective (the loaded parameters are taken as they are, as
torch's `__setstate__` does). A sharded wrapper (`zero=`) does not pickle: save its state_dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nccl_ddp.comm import api
from nccl_ddp.errors import ConfigError

_REBUILD = "_nccl_ddp_rebuild"  # the key of what __setstate__ rebuilds from
_TORCH_OPTIONS = ("device_ids", "output_device", "dim", "gradient_as_bucket_view")
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)  # nn.Module's own state (hooks, submodules)


def wrapper_state(ddp: Any) -> dict:
    """The wrapper's pickled state: nn.Module's own (the wrapped module, hooks on the wrapper,
    training) and the options to rebuild the rest from."""
    world = api.get_world_group() if api.is_initialized() else None
    if ddp.process_group is not world:
        raise ConfigError(
            f"rank {ddp.process_group.rank}: this DistributedDataParallel reduces over "
            f"{ddp.process_group.name!r}, not the world group: pickling is supported on the "
            "world group only (as torch's DDP pickles on its default group only); save "
            "model.state_dict() instead"
        )
    if ddp.config.zero is not None:
        raise ConfigError(
            f"rank {world.rank}: a DistributedDataParallel built with zero= holds only this "
            "rank's shard of the parameters and does not pickle; save model.state_dict()"
        )
    state = {k: v for k, v in ddp.__dict__.items() if k in _MODULE_KEYS}
    state[_REBUILD] = {
        "config": ddp.config,
        "torch": {k: getattr(ddp, k) for k in _TORCH_OPTIONS},
        "hook": ddp._torch_hook,
        "sync": ddp.require_backward_grad_sync,
    }
    return state


def restore(ddp: Any, state: dict, build: Any) -> None:
    """Undo `wrapper_state` into the bare `ddp`: nn.Module's state, then `build(module,
    config, torch_options)` (the wrapper's own construction, without its init sync), then the
    hook and no_sync's switch as they were."""
    state = dict(state)
    rebuild = state.pop(_REBUILD)
    torch.nn.Module.__setstate__(ddp, state)
    config = rebuild["config"]
    build(ddp.module, dataclasses.replace(config, init_sync=False), rebuild["torch"])
    ddp.config = config
    hook = rebuild["hook"]
    if hook is not None and hook[0] == "builtin":
        ddp._register_builtin_comm_hook(hook[1])
    elif hook is not None:
        ddp.register_comm_hook(hook[1], hook[2])
    ddp.require_backward_grad_sync = rebuild["sync"]
