"""`DistributedDataParallel` of a `torch.nn.Module` is itself a `torch.nn.Module`, as torch's is.

`.module` is the wrapped model; `parameters()`, `named_parameters()`, `state_dict()` and
`load_state_dict()` carry torch DDP's `module.` prefix, so a checkpoint of a model wrapped in
torch's DDP loads into ours and the reverse; `train()`/`eval()` return the wrapper; forward hooks
and `zero_grad()` are torch's. torch's keyword arguments are accepted beside MindSpore's
signature (`device_ids`, `output_device`, `dim`, `broadcast_buffers`, `gradient_as_bucket_view`,
...); one we cannot honour is a `ConfigError` saying why.

What torch's own code and the libraries built on torch DDP read from it is here too
(Lightning's DDPStrategy, Accelerate): `static_graph`, `find_unused_parameters`,
`require_backward_grad_sync` / `require_forward_param_sync` (no_sync's switches),
`_get_ddp_logging_data()`, and the reducer's `prepare_for_backward` / `_rebuild_buckets` /
`_delay_all_reduce`. The wrapper is a torch `Joinable` (torch's `Join([model])` works, as does
`nccl_ddp.Join`), and `register_comm_hook` takes torch's hooks (adapters/torch/comm_hooks.py).

torch.compile: `forward` runs in a frame that dynamo skips (torch DDP does the same) and the step's
bookkeeping is marked to be skipped too, so compiling the wrapper compiles the wrapped module's
forward and nothing of ours. Backward's grad hooks run in the autograd engine, outside compiled
code.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, cast

import torch
from torch.distributed.algorithms.join import Joinable as _TorchJoinable

from nccl_ddp.adapters.torch import comm_hooks as torch_hooks
from nccl_ddp.adapters.torch import pickling
from nccl_ddp.adapters.torch.adapter import TorchModule
from nccl_ddp.adapters.torch.dist import join_torch_world
from nccl_ddp.adapters.torch.options import check_torch_options, device_ids_of
from nccl_ddp.adapters.torch.sparse import SparseParams
from nccl_ddp.comm.api import resolve_group
from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.ddp.join import JoinConfig, JoinState
from nccl_ddp.ddp.reducer import Reducer
from nccl_ddp.errors import ConfigError, ConfigTypeError, ReducerError

_CORE = inspect.signature(DistributedDataParallel.__init__)
"""The core's options: they pass through as given, so a new one is added in one place."""


class TorchReducer(Reducer):
    """The reducer with the part of torch's `Reducer` API that code written for torch DDP calls
    (Lightning's manual optimization, Accelerate's trigger_sync_in_backward)."""

    join_state: Optional[JoinState] = None  # its wrapper's Join state (set by the wrapper)

    def prepare_for_backward(self, outputs: Any = None) -> None:
        """The coming backward all-reduces iff sync is enabled now (torch decides it here). Our
        forward opened the step already: one opened under no_sync() that has no grad yet
        switches to syncing, and the reverse. Unused parameters are found when the step ends,
        so `outputs` is not searched."""
        if not self.step.open or self.step.count or self.step.syncs == self.sync_enabled:
            return
        if self.join_state is not None and self.join_state.config.enable:
            raise ConfigError(
                f"rank {self.group.rank}: inside Join, decide no_sync() before the "
                "forward; prepare_for_backward cannot change this step's sync"
            )
        self.start_step()  # (the adapter hears of the new sync through its step_opened hook)

    def _rebuild_buckets(self) -> bool:
        """torch rebuilds its buckets here after the first step; ours are rebuilt when the
        first step closes. Nothing to do: False, as torch answers when it rebuilt none."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's static-graph first step all-reduces here; ours did when backward ended."""


class TorchDistributedDataParallel(torch.nn.Module, DistributedDataParallel, _TorchJoinable):
    """What `nccl_ddp.DistributedDataParallel(torch_module, ...)` builds: the core's arguments
    (positional and keyword, as `DistributedDataParallel` takes them) plus torch's own."""

    reducer_class = TorchReducer
    _torch_join_config: Any = None  # the config torch's Join set last (see _join_config)
    _torch_hook: Any = None  # the comm hook as registered, for pickling: ("hook", state, hook)

    def __init__(
        self,
        module: Any,
        *args: Any,
        device_ids: Any = None,
        output_device: Any = None,
        dim: int = 0,
        gradient_as_bucket_view: bool = False,
        check_reduction: bool = False,
        **kwargs: Any,
    ) -> None:
        torch.nn.Module.__init__(self)
        core = {k: v for k, v in kwargs.items() if k in _CORE.parameters}
        torch_options = {k: v for k, v in kwargs.items() if k not in core}
        given = _CORE.bind_partial(self, module, *args, **core).arguments
        init_sync, process_group = given.get("init_sync", True), given.get("process_group")
        if isinstance(init_sync, (list, tuple)):
            raise ConfigTypeError(
                f"init_sync must be a bool, got {init_sync!r}: the second positional argument is "
                "init_sync (MindSpore's signature), not torch's device_ids; pass "
                "device_ids=[...] by keyword"
            )
        check_torch_options(torch_options, dim, gradient_as_bucket_view, check_reduction)
        if not isinstance(module, torch.nn.Module):
            raise ConfigTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _refuse_fully_shard(module)
        join_torch_world(process_group, "DistributedDataParallel")
        config = given.get("config")
        if given.get("zero") is not None or (isinstance(config, DDPConfig) and config.zero is not None):
            rank = resolve_group(process_group, "process_group").rank
            SparseParams.of(module).refuse(rank, "ZeRO (zero=ZeroConfig(...))")
        self.device_ids, self.output_device = device_ids_of(module, device_ids, output_device, process_group)
        self.dim = dim
        self.gradient_as_bucket_view = gradient_as_bucket_view
        DistributedDataParallel.__init__(self, module, *args, **core)
        self._torch_reducer.join_state = self.join_state

    # ---- torch.save(model) / torch.load / copy.deepcopy, as torch's DDP (adapters/torch/pickling.py)
    def __getstate__(self) -> dict:
        return pickling.wrapper_state(self)

    def __setstate__(self, state: dict) -> None:
        pickling.restore(self, state, self._rebuild)

    def _rebuild(self, module: Any, config: Any, options: dict) -> None:
        """The construction after unpickling: on the world group in force, no init sync."""
        join_torch_world(None, "DistributedDataParallel (unpickled)")
        for name, value in options.items():
            setattr(self, name, value)
        DistributedDataParallel.__init__(self, module, config=config)
        self._torch_reducer.join_state = self.join_state

    # ---- what code written for torch DDP reads (Lightning, Accelerate)
    @property
    def static_graph(self) -> bool:
        return self.config.static_graph

    @property
    def find_unused_parameters(self) -> bool:
        return self.config.find_unused_parameters

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next step all-reduces (torch's flag; no_sync() clears it)."""
        return self.reducer.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync_enabled = bool(value)

    @property
    def require_forward_param_sync(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers first (with broadcast_buffers)."""
        return self._sync_buffers_next

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._sync_buffers_next = bool(value)

    def _get_ddp_logging_data(self) -> dict:
        """torch's DDP logging data, the keys we know (Lightning reads can_set_static_graph: we
        do not analyse the graph, so it is False)."""
        g = self.process_group
        hook = self.reducer.comm_hook
        return {
            "world_size": g.size,
            "rank": g.rank,
            "backend_name": f"nccl_ddp-{g.backend}",
            "module_name": type(self.module).__name__,
            "bucket_cap_bytes": self.config.cap_bytes,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "broadcast_buffers": self.broadcast_buffers,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "comm_hook": "" if hook is None else getattr(hook[1], "__qualname__", ""),
            "iteration": self.reducer.steps,
            "can_set_static_graph": False,
        }

    @property
    def broadcast_buffers(self) -> bool:
        return self.config.broadcast_buffers

    # ---- torch's comm hooks and Join
    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch's contract: nccl_ddp.hooks as they are; torch's default hooks (state None) as
        their fused equivalents; any other hook on torch tensors (adapters/torch/comm_hooks.py).
        Checked as torch checks it, with torch's error types and messages."""
        rank = self.process_group.rank
        torch_hooks.check_like_torch(hook, rank)
        self._check_no_hook_yet()
        given, ours = hook, torch_hooks.ours_for(hook, state)
        if ours is not None:
            hook = ours
        elif callable(hook) and not torch_hooks.is_ours(hook):
            torch_hooks.check_torch_world(hook, state, self.process_group)
            params = {id(n): p for n, p in zip(self.reducer.params, self._torch_module.params)}
            hook = torch_hooks.TorchHook(hook, params, self._torch_module.on_cuda)
        name = getattr(given, "__name__", type(given).__name__)
        through = self._sparse_through(hook, f"register_comm_hook({name})", state)
        super().register_comm_hook(state, hook)
        self._torch_module.sparse_params.through_hook = through
        self._torch_hook = ("hook", state, given)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks (`dist.BuiltinCommHookType.ALLREDUCE`, `FP16_COMPRESS`): ours,
        fused into the bucket kernels. Once, as torch's."""
        hook = torch_hooks.builtin_hook(comm_hook_type, self.process_group.rank)
        self._check_no_hook_yet()
        self._sparse_through(hook, f"register_builtin_comm_hook({comm_hook_type})", None)
        super().register_comm_hook(None, hook)
        self._torch_hook = ("builtin", comm_hook_type)

    def _sparse_through(self, hook: Any, what: str, state: Any) -> Any:
        """How sparse grads go through `hook` as torch's do, or its refusal (comm_hooks.py)."""
        sparse, rank = self._torch_module.sparse_params, self.process_group.rank
        return torch_hooks.route_sparse(
            sparse, hook, what, state, lambda: len(self.reducer.layout.buckets), rank
        )

    def _check_no_hook_yet(self) -> None:
        """torch's reducer takes one hook (RuntimeError, torch's message)."""
        if self.reducer.comm_hook is not None:
            raise ReducerError(
                f"rank {self.process_group.rank}: register_comm_hook or register_builtin_comm_hook "
                "can only be called once."
            )

    def join_hook(self, **kwargs: Any) -> Any:
        """Join (ours or torch's): a joined rank cannot stand in for the all-gathers of sparse
        grads (adapters/torch/sparse.py), so a model with them is refused."""
        self._torch_module.sparse_params.refuse(self.process_group.rank, "Join (uneven inputs)")
        return super().join_hook(**kwargs)

    @property
    def join_device(self) -> Any:
        """torch's Join: where its count tensors live (the parameters' device)."""
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        """torch's Join counts ranks with torch.distributed on this group: torch's default group
        when torch.distributed is initialised with our ranks, else ours (never raises: typing's
        Protocol check in nccl_ddp.Join reads it; torch's Join then fails in torch.distributed,
        which it needs initialised on our ranks)."""
        import torch.distributed as dist

        g = self.process_group
        if (
            dist.is_available()
            and dist.is_initialized()
            and (dist.get_world_size(), dist.get_rank()) == (g.size, g.rank)
        ):
            return dist.group.WORLD
        return g

    @property
    def nccl_ddp_join_group(self) -> Any:
        """Our group, the one nccl_ddp.Join counts on (join_process_group is torch's)."""
        return self.process_group

    @property
    def _join_config(self) -> Any:
        """torch's Join keeps its config here: it becomes ours (the same three fields), so the
        step's Join protocol runs; `_join_count` then answers torch's Join."""
        return self.join_state.config

    @_join_config.setter
    def _join_config(self, cfg: Any) -> None:
        ours = JoinConfig(bool(cfg.enable), bool(cfg.throw_on_early_termination), bool(cfg.is_first_joinable))
        self.join_state.config = self._torch_join_config = ours

    def _join_count(self) -> Optional[int]:
        """Inside torch's Join (the config is the one it set): torch's notification, an
        all-reduce of 1 on torch's group that the joined ranks' count matches; the ranks still
        training. Inside nccl_ddp.Join: ours."""
        if self.join_state.config is not self._torch_join_config:
            return super()._join_count()
        from torch.distributed.algorithms.join import Join as TorchJoin

        work = TorchJoin.notify_join_context(self)
        if work is None:
            return None
        work.wait()
        return int(work.result()[0].item())

    @torch._disable_dynamo(recursive=False)  # (lazy torch.compiler.disable; torch DDP's way)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._before_forward(inputs, kwargs)
        prof, stream = self.reducer.prof, self.reducer.device.current_stream()
        prof.mark("forward", "start", stream)  # the timeline's forward span (off: one `if`)
        try:
            out = self.module(*inputs, **kwargs)
        finally:
            prof.mark("forward", "end", stream)
        self._after_forward()
        return out

    @torch._disable_dynamo
    def _after_forward(self) -> None:
        """torch's _post_forward: whether the next forward broadcasts the buffers is decided
        now, from the flags as the forward leaves them (Lightning's manual optimization turns
        require_backward_grad_sync off inside the forward: then torch skips the next sync)."""
        self._sync_buffers_next = torch.is_grad_enabled() and self.reducer.sync_enabled

    @torch._disable_dynamo
    def _before_forward(self, inputs: tuple, kwargs: dict) -> tuple:
        """Open the step (buffers from rank 0 first when due), point grads at the buckets, and
        with device_ids move the inputs there, as torch DDP does."""
        self._pre_forward()
        self._torch_module.before_forward()
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs

            moved, moved_kwargs = _to_kwargs(inputs, kwargs, torch.device("cuda", self.device_ids[0]), False)
            return moved[0], moved_kwargs[0]
        return inputs, kwargs

    @property
    def _torch_module(self) -> TorchModule:
        return cast(TorchModule, self._adapter)

    @property
    def _torch_reducer(self) -> TorchReducer:
        return cast(TorchReducer, self.reducer)  # built as reducer_class

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        """torch's; with a shard core whose parameter all-gathers are pending
        (`ZeroConfig(overlap_param_gather=True)` after `step()`), they finish first, so what is
        read through the wrapper (`parameters()` too) are the stepped values."""
        core = getattr(getattr(self, "reducer", None), "shard_core", None)
        if core is not None:
            core.shard_memory.wait_all()
        return super().named_parameters(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> TorchDistributedDataParallel:
        """to()/cuda()/half()... : a conversion that keeps every tensor's device and dtype
        (memory format, share_memory()) is done and the grads alias the buckets again; one that
        would move or cast the parameters under the reducer is refused before anything changes."""
        if self._closed is not None:  # a closed wrapper is a plain module
            return torch.nn.Module._apply(self, fn, recurse)
        kinds = {(t.dtype, t.device) for t in (*self.module.parameters(), *self.module.buffers())}
        for dtype, device in kinds:
            probe = torch.empty(0, dtype=dtype, device=device)
            out = fn(probe)
            if isinstance(out, torch.Tensor) and (out.dtype, out.device) != (dtype, device):
                raise ConfigError(
                    f"rank {self.process_group.rank}: DistributedDataParallel was built for "
                    f"{dtype} tensors on {device}; this conversion would make them {out.dtype} "
                    f"on {out.device}. Move or cast the module before wrapping it (or wrap the "
                    "converted module again)"
                )
        super()._apply(fn, recurse)
        self._torch_module.realias_grads()
        return self


def _refuse_fully_shard(module: torch.nn.Module) -> None:
    """A model sharded by `fully_shard` (ours or torch's) holds DTensor shards whose grads its
    units install after backward, where our DDP's grad hooks never see them: refused, pointing
    at the 2-D mesh, which does what DDP over the shards would (HSDP)."""
    import sys

    import torch.distributed as dist

    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded: no import for it
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = next((n for n, m in module.named_modules() if isinstance(m, FSDPModule)), None)
    if sharded is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        cls = type(module.get_submodule(sharded)).__name__
        where = f"{cls} at {sharded!r}" if sharded else f"{cls} at the root"
        raise ConfigError(
            f"rank {rank}: DistributedDataParallel got a model sharded by fully_shard ({where}): DDP "
            "over a sharded model is not supported. For HSDP (shard inside a node, replicate "
            "across nodes) give fully_shard a 2-D mesh instead, e.g. mesh=init_device_mesh('cpu', "
            "(nodes, ranks_per_node)): it reduce-scatters in the shard group and all-reduces the "
            "shards over the replicate group (mesh dim 0)"
        )
