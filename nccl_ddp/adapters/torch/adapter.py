"""PyTorch adapter: `torch.nn.Module` for `DistributedDataParallel`, lists of tensors for
`DistributedGradReducer` (adapters/torch/grad_lists.py). Data crosses only through DLPack, without copies
(adapters/torch/tensors.py).

DDP: every parameter's `.grad` becomes a view of our bucket memory (`p.grad =
torch.from_dlpack(bucket_view)`), so autograd accumulates straight into the bucket (PyTorch's
gradient_as_bucket_view). A `register_post_accumulate_grad_hook` per parameter marks it ready; the
reducer all-reduces full buckets on its comm stream while backward goes on, and a callback queued
on the autograd engine finalizes the step when backward ends. On CUDA the current torch stream is
the compute stream. PyTorch's grad semantics are kept: a parameter whose `.grad` was None (after
`optimizer.zero_grad()`) and that no rank used in a step keeps `.grad = None`. Sparse grads
(Embedding(sparse=True)) stay out of the buckets and are reduced as sparse (adapters/torch/sparse.py).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Callable, ContextManager, List, NoReturn, Optional, Sequence

from nccl_ddp.adapters.torch.grad_lists import TorchGrads
from nccl_ddp.adapters.torch.pooled_grads import PooledGrads
from nccl_ddp.adapters.torch.sparse import SparseParams
from nccl_ddp.adapters.torch.tensors import from_native, is_cuda, to_native, torch_stream_current
from nccl_ddp.adapters.torch.watch import ModuleWatch, check_initialized, check_same_params
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradModule, Named, StepDriver
from nccl_ddp.errors import ConfigError, ConfigTypeError, NcclDdpError
from nccl_ddp.zero.core import ShardCore

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_COPY_IN_NUMEL = 1 << 16  # a grad this large that is None at forward is copied in by its hook


def adapt(module: object) -> TorchModule:
    """The DDP adapter for a `torch.nn.Module`."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigTypeError(
            f"expected a torch.nn.Module, got {type(module).__module__}.{type(module).__name__}"
        )
    return TorchModule(module)


def grads_adapter() -> TorchGrads:
    return TorchGrads()


def array_from_native(native: NativeArray, like: object = None) -> torch.Tensor:
    """A collective's result for a torch caller: a tensor over `native` (no copy)."""
    return from_native(native)


def dlpack_source(x: object) -> None:
    """None: torch tensors speak `__dlpack__` themselves."""
    return None


OWNER_ATTR = "_nccl_ddp_owner"
"""The attribute our DistributedDataParallel sets on each parameter it reduces, as torch's FSDP
marks its own: a weak reference to the wrapper's TorchModule (and through it the model's shard
core, `zero=`). How `ZeroRedundancyOptimizer` finds the model of its parameters."""


class _OwnerRef(weakref.ref):
    """The mark: a weak reference that pickles (torch.save / deepcopy of the model) as no mark;
    the copy is no wrapper's until one wraps it."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (type(None), ())


def owner_of(param: torch.Tensor) -> Optional[TorchModule]:
    """The TorchModule (of an nccl_ddp DistributedDataParallel) whose reducer reduces `param`'s
    grad, or None: read from the parameter's own mark (`OWNER_ATTR`)."""
    ref = getattr(param, OWNER_ATTR, None)
    owner = ref() if isinstance(ref, weakref.ref) else None
    if owner is None or owner._driver is None:
        return None
    i = owner._index.get(id(param))
    return owner if i is not None and owner.params[i] is param else None


# ---------------------------------------------------------------------------------------------
# DistributedDataParallel


class TorchModule(GradModule):
    """A `torch.nn.Module` seen by the reducer: its trainable parameters, their grads (tensors we
    own, aliasing bucket memory once the reducer installs views) and autograd hooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        import torch

        self.module = module
        check_initialized(module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.sparse_params = SparseParams.of(module)  # reduced as sparse at the end of backward, unbucketed
        self.names: List[Optional[str]] = [n for n, p in named if id(p) not in self.sparse_params.ids]
        self.params = [p for _, p in named if id(p) not in self.sparse_params.ids]
        for n, p in named:
            if p.layout != torch.strided:
                raise ConfigError(
                    f"parameter {n!r} has layout {p.layout}; DistributedDataParallel "
                    "reduces dense parameters only: make it dense (p.to_dense()) "
                    "before wrapping the module"
                )
        devices = {str(p.device) for _, p in named}
        if len(devices) > 1:
            raise ConfigError(
                f"all parameters must be on one device, found {sorted(devices)}; "
                "one process drives one device"
            )
        self.on_cuda = bool(named) and is_cuda(named[0][1])
        # _grads[i]: the tensor the reducer's grads[i] aliases; p.grad is set to it at forward.
        self._grads = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._watch = ModuleWatch(module, self.params)
        self._driver: Optional[StepDriver] = None  # the wrapper's step (its reducer): attach()
        self._grad_hooks: list = []
        self._was_none: List[int] = []  # params whose .grad was None at this step's forward
        self._callback_queued = False
        self._syncing = True  # whether this step all-reduces (step_opened; before, a hook's guess)
        self._forward_opened = False  # the step was opened by our forward, not by a hook
        self._pooled: Optional[PooledGrads] = None  # ZeRO-2: grads handed over, not bucket views

    # ---- GradModule
    def native_params(self) -> List[NativeArray]:
        # (a non-contiguous parameter, e.g. a channels_last conv weight, is a strided view: its
        # grad is contiguous bucket memory all the same, which autograd accumulates into)
        return [to_native(p) for p in self.params]

    def native_grads(self) -> List[NativeArray]:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._grads[i].copy_(p.grad)
                p.grad = self._grads[i]
        return [to_native(g) for g in self._grads]

    @property
    def can_install_grads(self) -> bool:
        return True

    @property
    def reduces_unbucketed(self) -> bool:
        return bool(self.sparse_params)

    @property
    def pools_grads(self) -> bool:
        return True

    def install_grad(self, i: int, view: NativeArray) -> None:
        """The reducer moved grad i into bucket memory: from now on `p.grad` is that view."""
        p, old = self.params[i], self._grads[i]
        self._grads[i] = from_native(view)
        if p.grad is not None and p.grad.data_ptr() == old.data_ptr():
            p.grad = self._grads[i]

    def realias_grads(self) -> None:
        """After a module conversion (to(memory_format=...), share_memory()) gave the grad tensors
        new storage: make them our memory again (the reducer's), keeping their values."""
        import torch

        if self._pooled is not None:  # (no bucket views under ZeRO-2)
            return
        for i, p in enumerate(self.params):
            mine, old = from_native(self.driver.grads[i]), self._grads[i]
            if old.data_ptr() == mine.data_ptr():
                continue
            with torch.no_grad():
                mine.copy_(old)
            self._grads[i] = mine
            if p.grad is not None:
                p.grad = mine

    @property
    def can_install_params(self) -> bool:
        return True

    def install_param(self, i: int, view: NativeArray) -> None:
        """The shard core (zero=) moved parameter i into its flat buffer: `p.data` is that view
        (the Parameter object, its hooks and its mark stay)."""
        self.params[i].data = from_native(view)

    def param_moved(self, param: torch.nn.Parameter, view: NativeArray) -> None:
        """A shard core built outside the wrapper (the optimizer's ZeRO-1) moved `param` into
        its flat buffer: the reducer's array and `p.data` follow."""
        self.driver.param_moved(self.index_of(param), view)

    @property
    def shard_core(self) -> Optional[ShardCore]:
        """The model's shard core (`DistributedDataParallel(..., zero=ZeroConfig(...))`), or
        None: what ZeroRedundancyOptimizer steps."""
        return None if self._driver is None else self._driver.shard_core

    @property
    def driver(self) -> StepDriver:
        """The step this module's hooks feed: its wrapper's reducer (set by `attach`)."""
        if self._driver is None:
            raise ConfigError("this module is not wrapped in a DistributedDataParallel yet")
        return self._driver

    @property
    def group(self) -> ProcessGroup:
        """The wrapper's process group."""
        return self.driver.group

    def index_of(self, param: object) -> int:
        if isinstance(param, str):
            return self.names.index(param) if param in self.names else _missing(param)
        i = self._index.get(id(param))
        return i if i is not None else _missing(param)

    def attach(self, driver: StepDriver) -> None:
        """Register the grad hooks. A wrapper of these parameters built before and not closed
        (a second Trainer.fit, a new Accelerator's prepare, `DDP(model)` again) is closed first:
        the newest wrapper owns them, as only one reducer may see their grads."""
        self._driver = driver
        older = {id(o): o for o in map(owner_of, self.params) if o is not None and o is not self}
        for old in older.values():
            old.superseded()
        core = driver.shard_core
        if core is not None and core.reduce is not None:  # ZeRO-2: torch's grads, handed over per step
            self._pooled = PooledGrads(self.params, driver, core.reduce, to_native)
            self._grads = [None] * len(self.params)  # (a p.grad given before wrapping stays)
        for i, p in enumerate(self.params):
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook_for(i)))
            if self._pooled is not None:
                self._grad_hooks.append(p.register_hook(self._open_without_forward))
            setattr(p, OWNER_ATTR, _OwnerRef(self))
        for p in self.sparse_params.params:  # (no bucket: only the end of backward is theirs)
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._sparse_ready))

    def _sparse_ready(self, p: torch.nn.Parameter) -> None:
        if not self._callback_queued:
            self._queue_end_of_backward()

    def _open_without_forward(self, grad: torch.Tensor) -> None:
        """ZeRO-2, before a grad is accumulated: in a backward without our forward (the module
        called directly), the first one opens the step as the forward would (the placeholders
        the last step left in `p.grad` make way for torch's grads)."""
        if not self._forward_opened and self._pooled is not None:
            self._syncing, self._forward_opened = self.driver.sync_enabled, True
            self._was_none = self._pooled.open(self._syncing)

    def superseded(self) -> None:
        """A newer wrapper took these parameters: close ours (its pending communication is
        waited for; a failure there is the old job's, logged, not raised into the new one)."""
        try:
            self.driver.close("a newer DistributedDataParallel wraps the same parameters")
        except NcclDdpError as e:
            log.warning("closing the older DistributedDataParallel of these parameters: %s", e)
        finally:
            self.detach()

    def forward(self, *args: object, **kwargs: object) -> object:
        self.before_forward()
        return self.module(*args, **kwargs)

    def before_forward(self) -> None:
        """The wrapper has just opened the step (reducer.prepare), reading sync_enabled as we do:
        check that the trainable parameters are still the wrapped ones, point grads at buckets."""
        if not self._watch.params_unchanged():
            check_same_params(self.module, self.params, self.names, self.sparse_params.ids, self.group.rank)
            self._watch.params_checked()
        self._forward_opened = True
        if self._pooled is not None:
            self._was_none = self._pooled.open(self._syncing)
        else:
            self._point_grads_at_buckets()

    # ---- the step
    def step_opened(self, syncs: bool) -> None:
        self._syncing = syncs

    def before_step_end(self, missing: Sequence[int]) -> None:
        """A grad still None (its view not installed: large, or no forward) that got none this
        step is reduced as zeros: its view is zeroed and installed (`_end_of_backward` gives
        None back to those no rank used)."""
        if self._pooled is not None:  # (ZeRO-2: the pool reduces a grad not handed in as zeros)
            return
        for i in missing:
            if self.params[i].grad is None:
                self._grads[i].zero_()
                self.params[i].grad = self._grads[i]

    def _point_grads_at_buckets(self) -> None:
        """Before backward: every `.grad` that is set becomes our bucket view (one the user
        replaced is copied in), so autograd accumulates in place. One that is None (after
        `zero_grad()`) gets its view zeroed if it is small; a large one stays None until its grad
        is ready, when the hook copies torch's fresh grad into the view, as torch's reducer does
        (one pass over it instead of a fill and an add; for small grads the hook's copy costs
        more than both). `_end_of_backward` zeroes the views of those that got none."""
        import torch

        self._was_none = []
        small = []
        with torch_stream_current(self.on_cuda):
            for i, (p, mine) in enumerate(zip(self.params, self._grads)):
                g = p.grad
                if g is None:
                    self._was_none.append(i)
                    if mine.numel() < _COPY_IN_NUMEL:
                        small.append(mine)
                        p.grad = mine
                elif g is not mine and g.data_ptr() != mine.data_ptr():
                    mine.copy_(g)
                    p.grad = mine
            if small:
                torch._foreach_zero_(small)

    def _grad_hook_for(self, i: int) -> Callable[[torch.nn.Parameter], None]:
        """The post-accumulate-grad hook of parameter i. It runs once per parameter per step, so
        it stays lean: it calls the reducer directly (i is a valid index), which enters torch's
        CUDA stream (`on_compute_stream`) only when a bucket completes."""
        mark_ready, grads, pooled = self.driver.mark_ready, self._grads, self._pooled
        if pooled is not None:

            def handed(p: torch.nn.Parameter) -> None:  # ZeRO-2: torch's own grad goes to the reducer
                if not self._callback_queued:
                    self._queue_end_of_backward()
                pooled.hand_over(i, p)
                mark_ready(i)

            handed.__name__ = f"nccl_ddp_grad_ready_{i}"
            return handed

        def hook(p: torch.nn.Parameter) -> None:
            if p.grad is not grads[i]:
                self._adopt_grad(i, p)
            if not self._callback_queued:
                self._queue_end_of_backward()
            mark_ready(i)

        hook.__name__ = f"nccl_ddp_grad_ready_{i}"
        return hook

    def _adopt_grad(self, i: int, p: torch.nn.Parameter) -> None:
        """The hook found `p.grad` is not our bucket view (the fresh grad of a `.grad` that was
        None at forward; backward without our forward; `.grad` replaced after forward): bring
        it into the bucket."""
        mine, g = self._grads[i], p.grad
        if g is not None and g.data_ptr() == mine.data_ptr():
            return
        if g is not None:
            mine.copy_(g)
        p.grad = mine

    def _queue_end_of_backward(self) -> None:
        """The first hook of a backward: finalize the step when the autograd engine is done."""
        import torch

        self._callback_queued = True
        if not self._forward_opened:  # backward without our forward: the hook opens the step
            self._syncing = self.driver.sync_enabled
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Runs on the autograd engine once backward has finished: close the step, then give
        `.grad = None` back to params that had it and that got no grad anywhere."""
        self._callback_queued = self._forward_opened = False
        # params whose hook did not run in this backward (read before finalize, which counts a
        # param used under no_sync() earlier as ready: it is reduced, as in PyTorch)
        driver = self.driver
        unused = driver.not_ready(self._was_none)
        with torch_stream_current(self.on_cuda):
            driver.finalize()  # (the step may have ended at its last grad already)
            if self._syncing:
                self.sparse_params.reduce(driver.group)
        if unused and self._syncing:
            untouched = driver.untouched_last_step()
            unused = [i for i in unused if i in untouched]
        for i in unused:
            self.params[i].grad = None
        if self._pooled is not None:
            self._pooled.end(self._syncing)

    # ---- state besides the trainable parameters: frozen parameters and buffers
    def named_frozen(self) -> List[Named]:
        return [  # (and those with sparse grads: not the reducer's, broadcast at init all the same)
            (n, self._native_state(n, p, "parameter"))
            for n, p in self.module.named_parameters()
            if not p.requires_grad or id(p) in self.sparse_params.ids
        ]

    def named_buffers(self) -> List[Named]:
        # cached: listed and converted again only when a buffer was added, replaced or moved
        return self._watch.buffers(self._native_buffer)

    def _native_buffer(self, name: str, b: torch.Tensor) -> NativeArray:
        return self._native_state(name, b, "buffer")

    def _native_state(self, name: str, t: torch.Tensor, what: str) -> NativeArray:
        """A writable native array (a strided view when `t` is not contiguous) of `t`."""
        if is_cuda(t) != self.on_cuda:
            raise ConfigError(
                f"{what} {name!r} is on {t.device}, the trainable parameters on "
                f"{'CUDA' if self.on_cuda else 'the CPU'}; move the whole module to one device "
                "before wrapping it"
            )
        return to_native(t)

    def grad_enabled(self) -> bool:
        import torch

        return torch.is_grad_enabled()

    def on_compute_stream(self) -> ContextManager[None]:
        return torch_stream_current(self.on_cuda)

    def detach(self) -> None:
        """The wrapper closed: its grad hooks go, and the parameters are no longer ours."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        for p in self.params:
            ref = getattr(p, OWNER_ATTR, None)
            if isinstance(ref, weakref.ref) and ref() is self:
                delattr(p, OWNER_ATTR)


def _missing(param: object) -> NoReturn:
    raise KeyError(param)


if TYPE_CHECKING:  # this module is torch's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.torch import adapter as _this

    _contract: FrameworkAdapter = _this
