"""PyTorch Lightning: `NcclDDPStrategy`, Lightning's `DDPStrategy` with our DDP wrapper where it
builds torch's, so a Lightning script changes one line:

    trainer = Trainer(strategy=NcclDDPStrategy(), accelerator="cpu", devices=2)

Lightning still starts the processes and initialises torch.distributed (its barriers, broadcasts
and metric syncs stay torch's); the strategy then joins our process group with the ranks Lightning
assigned (rank 0 picks a free port for our store and a job secret and broadcasts them through
torch.distributed, so no port torch holds is bound twice), wraps the LightningModule in our
`DistributedDataParallel`, and tears it down with the fit. Every place where Lightning asks
"is the model torch's DDP?" (no_sync for gradient accumulation, manual optimization's
prepare_for_backward, teardown) asks about ours here, and gradient clipping by norm on our
ZeroRedundancyOptimizer is its own global-norm clip. Imported only by `nccl_ddp.lightning`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional

from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import ddp as _lightning_ddp

from nccl_ddp.adapters.torch.ddp import TorchDistributedDataParallel
from nccl_ddp.adapters.torch.dist import init_beside_torch
from nccl_ddp.adapters.torch.integrations import private_names
from nccl_ddp.adapters.torch.zero.optimizer import ZeroRedundancyOptimizer
from nccl_ddp.comm import api
from nccl_ddp.errors import ConfigError
from nccl_ddp.job.env import DEFAULT_TIMEOUT

# DDPStrategy's private attributes that its __init__ sets and the strategy reads or replaces
INSTANCE_ATTRS = (
    "_ddp_kwargs",
    "_timeout",
    "_ddp_comm_hook",
    "_ddp_comm_wrapper",
    "_ddp_comm_state",
    "_forward_redirection",
)


def private_names_present() -> Dict[str, bool]:
    """Lightning's private names the strategy relies on -> whether this Lightning has them (a
    method we override that Lightning no longer calls would silently bring torch's DDP back)."""
    redirection = getattr(_lightning_ddp, "_DDPForwardRedirection", None)
    own = vars(redirection) if redirection is not None else {}
    return {  # defined by the class itself (Strategy has a _setup_model of its own that is no DDP)
        "lightning.pytorch.strategies.ddp._DDPForwardRedirection": redirection is not None,
        "_DDPForwardRedirection.on_after_inner_forward": "on_after_inner_forward" in own,
        "_DDPForwardRedirection.on_after_outer_forward": "on_after_outer_forward" in own,
        "DDPStrategy._setup_model": "_setup_model" in vars(DDPStrategy),
        "DDPStrategy._register_ddp_hooks": "_register_ddp_hooks" in vars(DDPStrategy),
    }


private_names.require("lightning", private_names_present())
_DDPForwardRedirection: Any = _lightning_ddp._DDPForwardRedirection


class _Redirection(_DDPForwardRedirection):
    """Manual optimization: the model's own backward sync is off between the inner and the outer
    forward, as Lightning does with torch's DDP."""

    def on_after_inner_forward(self, wrapper_module: Any, original_module: Any) -> None:
        if (
            isinstance(wrapper_module, TorchDistributedDataParallel)
            and not original_module.automatic_optimization
        ):
            wrapper_module.require_backward_grad_sync = False
        else:
            super().on_after_inner_forward(wrapper_module, original_module)

    def on_after_outer_forward(self, wrapper_module: Any, original_module: Any) -> None:
        if (
            isinstance(wrapper_module, TorchDistributedDataParallel)
            and not original_module.automatic_optimization
        ):
            wrapper_module.require_backward_grad_sync = True
        else:
            super().on_after_outer_forward(wrapper_module, original_module)


class NcclDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy reducing gradients with nccl_ddp. Takes DDPStrategy's arguments;
    keyword arguments it does not know go to our `DistributedDataParallel` (torch's names:
    find_unused_parameters, static_graph, bucket_cap_mb, ...). `nccl_backend`: our backend
    ("host" on the CPU, "nccl" on GPUs by default)."""

    strategy_name = "nccl_ddp"

    model: Any  # Lightning's attribute: the wrapped model (ours once set up)

    def __init__(self, *args: Any, nccl_backend: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        private_names.require("lightning", {f"DDPStrategy.{a}": hasattr(self, a) for a in INSTANCE_ATTRS})
        self._forward_redirection = _Redirection()
        self._nccl_backend = nccl_backend
        self._owns_group = False

    # ---- our process group, beside torch's
    def setup_distributed(self) -> None:
        super().setup_distributed()
        backend = self._nccl_backend or ("nccl" if self.root_device.type == "cuda" else "host")
        timeout = self._timeout.total_seconds() if self._timeout else DEFAULT_TIMEOUT
        self._owns_group = init_beside_torch(backend, self.global_rank, self.world_size, timeout, "Lightning")

    def setup_precision_plugin(self) -> None:
        """Lightning's, then `Trainer(gradient_clip_val=...)` (norm) on an nccl_ddp
        ZeroRedundancyOptimizer goes to its `clip_grad_norm_`: the global norm over its shards,
        which is also torch's result under ZeRO-1 (under ZeRO-2 p.grad holds local grads)."""
        super().setup_precision_plugin()
        _route_clipping(self.precision_plugin)

    def _setup_model(self, model: Any) -> TorchDistributedDataParallel:
        return TorchDistributedDataParallel(
            model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs
        )

    def _register_ddp_hooks(self) -> None:
        """Lightning's ddp_comm_state / ddp_comm_hook / ddp_comm_wrapper, on every device
        (torch's hooks work on our buckets; see adapters/torch/comm_hooks.py)."""
        if self._ddp_comm_hook is None:
            return
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self._ours().register_comm_hook(self._ddp_comm_state, hook)

    def _ours(self) -> TorchDistributedDataParallel:
        if not isinstance(self.model, TorchDistributedDataParallel):
            raise ConfigError(
                f"NcclDDPStrategy: the model is a {type(self.model).__name__}, "
                "not nccl_ddp's DistributedDataParallel"
            )
        return self.model

    # ---- where Lightning asks whether the model is torch's DDP
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        if isinstance(self.model, TorchDistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            with super().block_backward_sync():
                yield None

    def pre_backward(self, closure_loss: Any) -> None:
        if not isinstance(self.model, TorchDistributedDataParallel):
            return super().pre_backward(closure_loss)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)  # Lightning's, on our reducer
        return None

    def post_backward(self, closure_loss: Any) -> None:
        """torch's static-graph first step needs a flush after manual backward; ours all-reduced
        when backward ended."""
        if not isinstance(self.model, TorchDistributedDataParallel):
            super().post_backward(closure_loss)

    def teardown(self) -> None:
        if isinstance(self.model, TorchDistributedDataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()
        if self._owns_group:
            self._owns_group = False
            api.destroy_process_group()


def _route_clipping(plugin: Any) -> None:
    """Make `plugin.clip_grad_by_norm` call a sharded optimizer's own `clip_grad_norm_`."""
    if getattr(plugin, "_nccl_ddp_clip_routed", False):
        return
    theirs = plugin.clip_grad_by_norm

    def clip_grad_by_norm(optimizer: Any, clip_val: Any) -> None:
        opt = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        if isinstance(opt, ZeroRedundancyOptimizer):
            opt.clip_grad_norm_(clip_val)
        else:
            theirs(optimizer, clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin._nccl_ddp_clip_routed = True
