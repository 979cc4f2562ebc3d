"""Hugging Face Accelerate: `Accelerator`, accelerate's with our DDP wrapper where `prepare` builds
torch's, so a script changes one line:

    from nccl_ddp.accelerate import Accelerator      # was: from accelerate import Accelerator

Accelerate still starts torch.distributed (gloo on the CPU) and does everything else; when
`prepare` wraps a model for DDP, this Accelerator first joins our process group with Accelerate's
ranks (adapters/torch/dist.py), then lets accelerate build our `DistributedDataParallel` in place
of torch's (torch's name is ours only inside that call). `accumulate`/`no_sync`,
`DistributedDataParallelKwargs` (its comm_hook: torch's hooks, adapters/torch/comm_hooks.py),
`save_state`/`load_state`, `unwrap_model`, `trigger_sync_in_backward` and `join_uneven_inputs`
work on it; `clip_grad_norm_` on the parameters of our ZeroRedundancyOptimizer is its own
global-norm clip, `prepare` leaves that optimizer where its shards are, and `save_state`
consolidates its state on the main process first. `end_training()`
(or process exit) destroys our group.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import threading
from typing import Any, Dict, Iterator, cast

import accelerate
import torch

from nccl_ddp.adapters.torch.ddp import TorchDistributedDataParallel, TorchReducer
from nccl_ddp.adapters.torch.dist import init_beside_torch
from nccl_ddp.adapters.torch.integrations import private_names
from nccl_ddp.adapters.torch.zero.optimizer import ZeroRedundancyOptimizer
from nccl_ddp.comm import api
from nccl_ddp.job.env import DEFAULT_TIMEOUT

_PATCH = threading.Lock()
_TORCH_DDP = "torch.nn.parallel.DistributedDataParallel"


def private_names_present() -> Dict[str, bool]:
    """What the swap relies on -> whether this accelerate has it: `Accelerator.prepare_model` looks
    torch's DDP up by its full name when it wraps a model (a module-level import would keep
    torch's class, and prepare would silently build torch's DDP)."""
    try:
        source = inspect.getsource(accelerate.Accelerator.prepare_model)
    except (OSError, TypeError):  # no source installed: nothing to check against
        return {}
    return {f"the lookup of {_TORCH_DDP} inside Accelerator.prepare_model": f"{_TORCH_DDP}(" in source}


private_names.require("accelerate", private_names_present())


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator whose `prepare` wraps models in nccl_ddp's DistributedDataParallel.
    `nccl_backend`: ours ("host" on the CPU, "nccl" on GPUs by default); `zero`: an
    `nccl_ddp.ZeroConfig` the wrapped models are built with (ZeRO-2: `ZeroConfig(stage=2)`)."""

    def __init__(self, *args: Any, nccl_backend: str = "", zero: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._nccl_backend = nccl_backend
        self._zero = zero  # our DDP's zero= (an nccl_ddp.ZeroConfig), for the models it wraps
        self._owns_group = False
        self._wrapped: list = []  # our wrappers that prepare built (_models holds their modules)

    def prepare_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if self.num_processes > 1 and torch.distributed.is_initialized():
            self._join_group()
        with _ours_as_torch_ddp(self._zero):
            prepared = super().prepare_model(model, *args, **kwargs)
        if isinstance(prepared, TorchDistributedDataParallel):
            self._wrapped.append(prepared)
        return prepared

    def _join_group(self) -> None:
        backend = self._nccl_backend or ("nccl" if self.device.type == "cuda" else "host")
        if init_beside_torch(backend, self.process_index, self.num_processes, DEFAULT_TIMEOUT, "Accelerate"):
            self._owns_group = True
            atexit.register(self._destroy_group)

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
        """accelerate's; an nccl_ddp ZeroRedundancyOptimizer is not moved (its shards live on
        the parameters' device already, and its state_dict() is a consolidated collective's)."""
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            device_placement = False
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def clip_grad_norm_(self, parameters: Any, max_norm: Any, norm_type: Any = 2) -> Any:
        """accelerate's; the parameters of a prepared nccl_ddp ZeroRedundancyOptimizer are
        clipped by its `clip_grad_norm_` (the global norm over its shards; under ZeRO-2 p.grad
        holds local grads), after the usual unscale."""
        params = list(parameters)
        zero = self._zero_holding(params)
        if zero is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        self.unscale_gradients()
        return zero.clip_grad_norm_(max_norm, norm_type)

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        """accelerate's; the state of a prepared nccl_ddp ZeroRedundancyOptimizer is consolidated
        on the main process first (a collective; accelerate asks every rank for state_dict() and
        writes the main process's), so `load_state` gives every rank the full state back."""
        zeros = [
            z
            for z in (getattr(o, "optimizer", o) for o in self._optimizers)
            if isinstance(z, ZeroRedundancyOptimizer)
        ]
        for z in zeros:
            z.consolidate_state_dict(to=0)
        with contextlib.ExitStack() as stack:
            if self.process_index != 0:  # accelerate writes the main process's state only
                for z in zeros:
                    stack.enter_context(z.state_saved_elsewhere())
            return super().save_state(*args, **kwargs)

    def _zero_holding(self, params: list) -> Any:
        """The prepared ZeroRedundancyOptimizer whose parameters are exactly `params`, or None."""
        ids = {id(p) for p in params}
        for acc_opt in self._optimizers:
            opt = getattr(acc_opt, "optimizer", acc_opt)
            if isinstance(opt, ZeroRedundancyOptimizer):
                if ids == {id(p) for g in opt.param_groups for p in g["params"]}:
                    return opt
        return None

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, TorchDistributedDataParallel):
            model = model.module
        return super().unwrap_model(model, *args, **kwargs)

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: Any) -> Iterator[None]:
        if not isinstance(model, TorchDistributedDataParallel):
            with accelerate.Accelerator.trigger_sync_in_backward(model):
                yield
            return
        before = (model.require_backward_grad_sync, model.require_forward_param_sync)
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        cast(TorchReducer, model.reducer).prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before

    def end_training(self) -> None:
        self._destroy_group()
        super().end_training()

    def _destroy_group(self) -> None:
        if self._owns_group:
            self._owns_group = False
            for m in self._wrapped:
                m.close()
            self._wrapped = []
            api.destroy_process_group()


@contextlib.contextmanager
def _ours_as_torch_ddp(zero: Any = None) -> Iterator[None]:
    """`torch.nn.parallel.DistributedDataParallel` is our wrapper for the block: accelerate looks
    the name up when it wraps a model. `zero`: built with zero=zero (sharding is chosen when the
    model is built, and accelerate's DDP kwargs have no such field)."""
    ours: Any = TorchDistributedDataParallel
    if zero is not None:

        class _Sharded(TorchDistributedDataParallel):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, zero=zero, **kwargs)

        ours = _Sharded
    with _PATCH:
        theirs = torch.nn.parallel.DistributedDataParallel
        torch.nn.parallel.DistributedDataParallel = ours
        try:
            yield
        finally:
            torch.nn.parallel.DistributedDataParallel = theirs
