"""`ZeroRedundancyOptimizer` for PyTorch: torch's class's contract over our shard core.

Rank r steps only its slice of every flat bucket (zero/layout.py): the wrapped torch
optimizer gets one fp32 1-D tensor per (parameter, shard) piece, a view of our master shard, with
a view of our fp32 grad shard as its `.grad`; it must be elementwise. Parameters become views of
flat parameter buffers, all-gathered after every step. The stage follows the model: parameters of
an `nccl_ddp.DistributedDataParallel` built with `zero=ZeroConfig(...)` carry its shard core
(found through the mark the wrapper sets on each, adapters/torch/adapter.py `owner_of`), which this
optimizer steps (stage 2: its buckets are reduce-scattered); any other parameters get a ZeRO-1
core built here by the same factory (zero/core.py), over grads all-reduced whole.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Dict, Iterator, List, Optional

import torch

from nccl_ddp.adapters.torch.adapter import owner_of
from nccl_ddp.adapters.torch.dist import join_torch_world
from nccl_ddp.adapters.torch.tensors import from_native
from nccl_ddp.adapters.torch.zero.build import adopt_options, own_core, pick_stage, piece_groups
from nccl_ddp.adapters.torch.zero.gather_waits import GatherWaits
from nccl_ddp.adapters.torch.zero.guarded_grads import GradGuard
from nccl_ddp.adapters.torch.zero.state import (
    full_to_torch,
    local_state,
    set_local_state,
    torch_to_full,
)
from nccl_ddp.adapters.torch.zero.step import StepGrads
from nccl_ddp.comm.api import device_of, resolve_group
from nccl_ddp.ddp.join import JoinHook, JoinState
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool
from nccl_ddp.zero.checkpoint import consolidate, reshard
from nccl_ddp.zero.config import reduce_dtype_of

log = logging.getLogger(__name__)

_ELEMENTWISE = {
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "NAdam",
    "RAdam",
    "Rprop",
    "ASGD",
}
_EXTRA: set = set()


def register_elementwise(optimizer_class: type) -> type:
    """Declare a torch optimizer class elementwise (each element's update reads only that
    element of the grad and state), so it may step shards; returns the class (a decorator)."""
    _EXTRA.add(optimizer_class)
    return optimizer_class


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.ZeroRedundancyOptimizer's constructor and methods.

    Ours beyond torch's: `zero_stage` (None or 1: ZeRO-1, torch's; 2: ZeRO-2 over an nccl_ddp
    DistributedDataParallel model),
    `overlap_param_gather` (ZeRO-2: wait for each bucket's all-gather at its modules' next
    forward, or at `state_dict`/`load_state_dict`/`wait_for_params()`), `skip_nonfinite` (skip
    the step on every rank when any grad is NaN/Inf),
    `clip_grad_norm_`, `last_step_skipped`, `reduce_dtype` (ZeRO-2: None reduces the grads in
    their own dtype, torch.float32 / "float32" reduce-scatters bf16/fp16 buckets in fp32).
    """

    def __init__(
        self,
        params: Any,
        optimizer_class: type,
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        zero_stage: Optional[int] = None,
        overlap_param_gather: Optional[bool] = None,
        skip_nonfinite: bool = True,
        reduce_dtype: Any = None,
        **defaults: Any,
    ) -> None:
        _check_class(optimizer_class)
        check_bool("parameters_as_bucket_view", parameters_as_bucket_view)
        if overlap_param_gather is not None:
            check_bool("overlap_param_gather", overlap_param_gather)
        check_bool("skip_nonfinite", skip_nonfinite)
        if overlap_with_ddp:
            raise ConfigError(
                "overlap_with_ddp=True is torch's DDP-hook scheme; with nccl_ddp "
                "the optimizer and the reduce-scatter overlap by themselves when "
                "params come from nccl_ddp.DistributedDataParallel: drop the flag"
            )
        if zero_stage not in (None, 1, 2):
            raise ConfigError(f"zero_stage must be None, 1 or 2, got {zero_stage!r}")
        self.group = resolve_group(
            join_torch_world(process_group, "ZeroRedundancyOptimizer"), "process_group"
        )
        self.optimizer_class, self.skip_nonfinite = optimizer_class, skip_nonfinite
        self._asked = {
            "overlap_param_gather": overlap_param_gather,
            "reduce_dtype": reduce_dtype_of(reduce_dtype),
        }
        self.overlap_param_gather = False  # the model's ZeroConfig's, once built
        self.reduce_dtype: Any = None
        self._zero_stage = zero_stage
        self._built = False
        self._inner: Any = None
        self._consolidated: Optional[dict] = None
        self.last_step_skipped = False
        self.join_state = JoinState()  # nccl_ddp.Join's (a Joinable, as torch's class)
        super().__init__(params, defaults)
        self._build()

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The local optimizer stepping this rank's shards (torch's class's `.optim`)."""
        return self._inner

    # ------------------------------------------------------------------ layout

    def _build(self) -> None:
        """Find or build the shard core, build the inner optimizer over its pieces. Frozen
        parameters (requires_grad=False) are skipped, as torch's class skips them."""
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ConfigError("a parameter appears twice in the optimizer's param groups")
        for p in params:
            if not p.is_floating_point() or p.layout != torch.strided:
                raise ConfigError(
                    f"ZeroRedundancyOptimizer steps dense floating-point parameters; got {p.dtype} {p.layout}"
                )
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise ConfigError("ZeroRedundancyOptimizer: no parameter requires grad")
        self._stage, owner = pick_stage(trainable, self._zero_stage, self.group)
        adopt_options(self, self._asked, None if owner is None else owner.shard_core.config)
        self.device = device_of(self.group)
        if owner is not None:  # the model's core, built with it (zero=)
            order, names, core = owner.params, list(owner.names), owner.shard_core
        else:  # ZeRO-1 over grads all-reduced by anyone: a core of our own
            order, names, core = own_core(trainable, self.group, self.device)
        self._own_core = owner is None
        self.shard_core = core
        self.shard_memory = core.shard_memory
        self._order: List[Any] = list(order)
        self._names = [str(n) for n in names]
        self._index = {id(p): i for i, p in enumerate(self._order)}
        self._global = [self._index.get(id(p), -1) for p in params]  # state_dict id -> layout index
        self._pieces = self.shard_memory.pieces
        self._piece_params = [from_native(self.shard_memory.master_piece(pc)) for pc in self._pieces]
        piece_grads = [
            None
            if self.shard_memory.grads[pc.bucket] is None
            else from_native(self.shard_memory.grad_piece(pc))
            for pc in self._pieces
        ]
        self._grads = StepGrads(self._stage, self.shard_memory, self._order, piece_grads)
        self._param_views = [from_native(v) for v in self.shard_memory.params]  # what each p.data must be
        inner_groups = piece_groups(self.param_groups, self._pieces, self._piece_params, self._order)
        self._inner = self.optimizer_class(inner_groups, **self.defaults)
        for ours, theirs in zip(self.param_groups, self._inner.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    ours.setdefault(k, v)
        if self.overlap_param_gather:
            self._gather_waits = GatherWaits(self.shard_memory, owner.module, self._index)
        # ZeRO-2: GradScaler unscales and checks the shards through us (torch's contract), and
        # p.grad (local values) refuses to be read as the averaged grad
        self._step_supports_amp_scaling = self._stage == 2
        if self._stage == 2:
            self._grad_guard = GradGuard(self, self._order)
        self._built = True
        log.info(
            "rank %d: ZeRO-%d over %d parameters, %s",
            self.group.rank,
            self._stage,
            len(self._order),
            core.shards.summary(),
        )

    # ------------------------------------------------------------------ the step

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the grads by their global 2-norm, as torch.nn.utils.clip_grad_norm_ on the full
        grads would (ZeRO-1: `p.grad` itself is scaled; ZeRO-2: the reduced shards); one
        all-reduce. Call between backward and `step()`; returns the total norm."""
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_ supports norm_type=2 only, got {norm_type!r}")
        return torch.tensor(self._grads.clip_(max_norm))

    def _amp_unscale_shards(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """ZeRO-2: GradScaler's unscale-and-check of `p.grad` (guarded_grads.LocalGrad routes
        it here), on the reduced shards: `found_inf` is set on every rank when any rank's shard
        is non-finite (the global norm's all-reduce), so the ranks skip the same steps."""
        if self._grads.unscale_and_check(float(inv_scale)):
            found_inf.fill_(1.0)

    def _amp_step_scale(self) -> bool:
        """GradScaler's `_step_supports_amp_scaling` contract at `step()`: unscale the shards by
        `self.grad_scale` when it is set (not unscaled before); True when `self.found_inf` says
        to skip the step (the same on every rank: it came from `_amp_unscale_shards`)."""
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            self._grads.scale_(1.0 / float(scale))
        found = getattr(self, "found_inf", None)
        return found is not None and float(found) > 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step this rank's shards, then all-gather the parameters (per bucket)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._realias()
        amp_skip = self._amp_step_scale()
        grads = self._grads.collect()
        self.last_step_skipped = amp_skip or (
            self.skip_nonfinite and not math.isfinite(self._grads.global_norm())
        )
        self._grads.reset()
        if self.last_step_skipped:
            log.warning(
                "rank %d: non-finite grads: step skipped on every rank",
                self.group.rank,
            )
            return loss
        for ours, theirs in zip(self.param_groups, self._inner.param_groups):
            theirs.update({k: v for k, v in ours.items() if k != "params"})
        for pc, t, g in zip(self._pieces, self._piece_params, grads):
            t.grad = None if self._order[pc.param].grad is None else g
        self._inner.step()
        for t in self._piece_params:
            t.grad = None  # no reference to this step's grads is kept
        self.shard_memory.gather(wait=not self.overlap_param_gather)
        return loss

    def _realias(self) -> None:
        """A module conversion after construction (`model.to(...)`, which accelerate's and HF's
        `prepare` run after the optimizer is built) gave parameters new storage: copy their
        values into the flat buffers and make them views again, so that the step reaches the
        model instead of buffers nothing reads. A change of dtype or device is refused."""
        for i, (p, t) in enumerate(zip(self._order, self._param_views)):
            if p.data_ptr() == t.data_ptr():
                continue
            if (p.dtype, p.device, p.shape) != (t.dtype, t.device, t.shape):
                raise ConfigError(
                    f"rank {self.group.rank}: parameter {self._names[i]} became {p.dtype} on "
                    f"{p.device} after the ZeroRedundancyOptimizer was built for {t.dtype} on "
                    f"{t.device}; move or cast the model first, then build the optimizer"
                )
            with torch.no_grad():
                t.copy_(p.detach())
            model = owner_of(p)
            if model is not None:
                model.param_moved(p, self.shard_memory.params[i])
            else:
                p.data = t

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Before construction ends: torch's. After (ZeRO-1): the shards are cut again over the
        new parameter set, the state kept (a collective: every rank must call it)."""
        if not self._built:
            super().add_param_group(param_group)
            return
        if self._stage == 2:
            raise ConfigError(
                "add_param_group after construction with ZeRO-2: the parameters "
                "are the DistributedDataParallel model's, all given at once"
            )
        saved = self._full_state(to=None)
        assert saved is not None
        super().add_param_group(param_group)
        old = self.shard_core
        self._build()
        old.close()
        new = self.param_groups[-1]
        n0 = sum(len(g["params"]) for g in saved["param_groups"])
        saved["param_groups"].append(
            {
                **{k: v for k, v in new.items() if k != "params"},
                "params": list(range(n0, n0 + len(new["params"]))),
            }
        )
        self.load_state_dict(saved)

    # ------------------------------------------------------------------ state

    def _full_state(self, to: Optional[int]) -> Optional[dict]:
        self.shard_memory.wait_all()
        local = local_state(self._inner, self._piece_params, self.shard_memory)
        full = consolidate(self.shard_memory, local, to)
        if full is None:
            return None
        return full_to_torch(full, self._global, self.param_groups, self._order)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: the full optimizer state, as an unsharded optimizer would save it, is
        built on rank `to` (read it there with `state_dict()`)."""
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.group.size:
            raise ConfigError(
                f"consolidate_state_dict(to={to!r}): not a rank of the group (0..{self.group.size - 1})"
            )
        self._consolidated = self._full_state(to)

    def state_dict(self) -> dict:
        if self._consolidated is None:
            raise ConfigError(
                f"rank {self.group.rank}: optimizer state has not been consolidated on this rank; "
                "call consolidate_state_dict(to=this rank) on every rank first (after the last "
                "step)"
            )
        return self._consolidated

    @contextlib.contextmanager
    def state_saved_elsewhere(self) -> Iterator[None]:
        """For the block, `state_dict()` on this rank returns an empty state instead of asking
        for consolidation: for frameworks that ask every rank and write one rank's (accelerate's
        `save_state`), after `consolidate_state_dict(to=that rank)`."""
        self._consolidated = {"state": {}, "param_groups": []}
        try:
            yield
        finally:
            self._consolidated = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (consolidated, or an unsharded torch optimizer's) state on every rank,
        each keeping its shards' slices; checked whole before anything changes."""
        self.shard_memory.wait_all()
        self._realias()
        full, groups = torch_to_full(state_dict, self.param_groups, self._global, self._order, self._names)
        pieces = reshard(
            self.shard_memory.shards,
            self.shard_memory.rank,
            full,
            [p.numel() for p in self._order],
            self._names,
        )
        for ours, saved in zip(self.param_groups, groups):
            ours.update({k: v for k, v in saved.items() if k != "params"})
        set_local_state(self._inner, self._piece_params, pieces, self.shard_memory)
        self._consolidated = None

    # ------------------------------------------------------------------ Join (uneven inputs)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """`nccl_ddp.Join([model, opt])`'s hook, as torch's `_ZeROJoinHook`: a rank that ran out
        of data runs `step()` with its grads as they are (the last ones; set them first) each
        time the others step, so their norm all-reduce and parameter all-gathers are matched.
        ZeRO-1 only (a joined rank cannot stand in for ZeRO-2's reduce-scatter)."""
        if self._stage == 2:
            raise ConfigError(
                f"rank {self.group.rank}: Join with ZeRO-2: a joined rank cannot stand in for the "
                "reduce-scatter of the others; give every rank the same number of batches, or "
                "use ZeRO-1 (the default)"
            )
        return _StepJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The parameters' device (torch's Joinable)."""
        return self._order[0].device

    @property
    def join_process_group(self) -> Any:
        """The nccl_ddp group the optimizer's collectives run on."""
        return self.group

    def wait_for_params(self) -> None:
        """Wait for the parameter all-gathers that `step()` left pending
        (`overlap_param_gather=True`): after it, reading or writing the parameters directly
        (`p.copy_(...)`, a forward outside the model) is safe. A no-op when none is pending."""
        self.shard_memory.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._grads.reset()
        if self._stage == 2 and self.shard_core.reduce is not None:  # the next step starts from zero
            self.shard_core.reduce.accumulate = False

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer(ZeRO-{getattr(self, '_stage', '?')}, "
            f"{self.optimizer_class.__name__}, rank {self.group.rank}/{self.group.size})"
        )


class _StepJoinHook(JoinHook):
    def __init__(self, opt: ZeroRedundancyOptimizer) -> None:
        self.opt = opt

    def main_hook(self) -> None:
        self.opt.step()


def _check_class(cls: Any) -> None:
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ConfigTypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {cls!r}")
    if cls in _EXTRA or (cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENTWISE):
        return
    raise ConfigError(
        f"optimizer_class {cls.__module__}.{cls.__name__} is not known to be elementwise: a "
        "sharded optimizer steps each rank's slice of every parameter alone, so the update of an "
        "element may read only that element's grad and state (SGD, Adam, AdamW, ... are; LBFGS, "
        "Adafactor and SparseAdam are not). If yours is, declare it with "
        "nccl_ddp.adapters.torch.zero.optimizer.register_elementwise(cls)"
    )
