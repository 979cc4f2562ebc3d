"""`nccl_ddp.fully_shard`: torch FSDP2's public contract (`torch.distributed.fsdp.fully_shard`)
with the data moved by our process group.

Applied to submodules first and then to the root, as FSDP2: each call makes one unit of the
module's parameters that no sharded submodule holds, replaces them by `Shard(0)` DTensors (or
`Shard(d)`, chosen per parameter by `shard_placement_fn`) on the mesh (torch's optimizers,
`clip_grad_norm_` and `torch.distributed.checkpoint` take them as they take FSDP2's) and
changes the module's class to `FSDP<cls>`, an `FSDPModule` (torch's, so `isinstance` checks
hold) whose public methods are ours. The all-gathers and reduce-scatters go
through our group over the mesh's ranks (the host backend for CPU parameters, NCCL on the comm
stream for CUDA ones, with torch's current stream as the compute stream), never torch's
collectives.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from nccl_ddp.adapters.torch.fsdp import hooks, recast
from nccl_ddp.adapters.torch.fsdp.param import ShardedParam, Slot
from nccl_ddp.adapters.torch.fsdp.placement import (
    check_offload,
    device_for,
    mesh_for,
    ours_on,
    param_device,
    shard_dims,
)
from nccl_ddp.adapters.torch.fsdp.torch_methods import TorchOnlyMethods, TorchStateView
from nccl_ddp.adapters.torch.fsdp.unit import Schedule, State, Unit
from nccl_ddp.adapters.torch.tensors import torch_stream_current
from nccl_ddp.arrays.dlpack import numpy_dtype
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.param_sync import Subject, check_same_params
from nccl_ddp.device import Device
from nccl_ddp.errors import ConfigError, ConfigRuntimeError, ConfigTypeError
from nccl_ddp.zero.params import UnitShards, unit_layout

_UNIT = "_nccl_ddp_fsdp_unit"  # on a sharded module: its Unit; on a managed parameter: the unit's name
_SHARDED = Subject(
    "parameters of the module given to fully_shard",
    "parameter",
    "build the same model (same parameter names, shapes and dtypes) before fully_shard",
)


class FSDPModule(TorchOnlyMethods, TorchFSDPModule):
    """What `fully_shard` makes of a module (torch's FSDPModule methods, over our unit; those
    for torch's own comm machinery refused or accepted by `TorchOnlyMethods`)."""

    def _nccl_unit(self) -> Unit:
        return _unit_of(self, type(self).__name__)

    def _get_fsdp_state(self) -> Any:
        """Not torch's FSDPState: a view that runs our forward hooks for torch's
        `register_fsdp_forward_method` and names any other attribute in a ConfigError."""
        return TorchStateView(self, self._nccl_unit())

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for the collectives in flight,
        reshard every unit, drop the failed step's unreduced and partially reduced grads
        (`set_requires_gradient_sync(False)` / HSDP accumulation included) and clear the step's
        state, so the next forward and backward run cleanly (torch's). On the root only."""
        unit = self._nccl_unit()
        if unit is not unit.schedule.root:
            raise ConfigRuntimeError(
                f"reset_iter_state must be called on the root module (the one fully_shard was "
                f"applied to last), not on {type(self).__name__}"
            )
        with torch_stream_current(unit.schedule.on_cuda):
            unit.schedule.reset_iteration()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward reads none of this unit's parameters (an embedding's weight), so its
        pre-backward gathers nothing; its grads are still reduce-scattered (not recursive)."""
        self._nccl_unit().unshard_in_backward = bool(unshard_in_backward)

    def set_post_optim_event(self, event: Any) -> None:
        """The next gathers start after `event` (recorded after the optimizer step): on CUDA
        torch's current stream waits for it (each gather waits for that stream, so this
        orders, without torch's saving of the wait for the whole stream); on the host the
        step has run when this is called: nothing to wait for."""
        if self._nccl_unit().schedule.on_cuda:
            event.wait(torch.cuda.current_stream())

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted, changing nothing: ours gathers asynchronously on its comm stream either
        way, waited for at the unit's pre-forward / pre-backward (or by `unshard`'s handle)."""

    def _units(self, recurse: bool) -> List[Unit]:
        return _units_in([self], recurse)

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded DTensors (not recursive)."""
        unit = self._nccl_unit()
        with torch_stream_current(unit.schedule.on_cuda):
            unit.reshard()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """`to_empty(device="cpu")`, `.to(...)` and the like, on the sharded DTensors: after
        torch's `_apply` the units' parameters get their local tensors back in the shard memory
        (meta ones materialised there as zeros, for the init that follows); a cast to another
        dtype lays each changed unit's shards out anew first (recast.py)."""
        unit = self._nccl_unit()
        fn = args[0] if args else kwargs["fn"]
        for u in self._units(recurse=True):  # a change of device: refused before any moves
            for p in u.params:
                p.check_apply(fn)
        with torch_stream_current(unit.schedule.on_cuda):
            for u in self._units(recurse=True):
                u.reshard()
                dtypes = recast.new_dtypes(u, fn)
                if dtypes != [p.orig_dtype for p in u.params]:  # a cast: new shards first
                    recast.recast(u, dtypes)
        out = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # nn.Module's, not torch FSDP's
        for u in self._units(recurse=True):
            for p in u.params:
                p.materialise()
        return out

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather the parameters (not recursive); `async_op=True` returns a handle to wait on."""
        unit = self._nccl_unit()
        with torch_stream_current(unit.schedule.on_cuda):
            unit.unshard()
            if async_op:
                return UnshardHandle(unit)
            unit.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the local unsharded grads (no reduce-scatter) and adds them to
        the next synchronised backward's, which reduces the sum (torch's no_sync). Sets
        `set_requires_all_reduce` to the same value (torch's)."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = unit.requires_all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (2-D mesh): False still reduce-scatters each backward over the shard group but
        skips the all-reduce over the replicate group: the reduced shards accumulate apart (the
        sharded grads unchanged) until a backward with True adds them in and all-reduces the
        sum. On a 1-D mesh there is no replicate group: no effect (as torch's)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_forward = _check_reshard(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's contract: every backward of ours ends by waiting for its
        reduce-scatters, so there is nothing to defer."""

    def set_modules_to_forward_prefetch(self, modules: List[Any]) -> None:
        self._nccl_unit().forward_prefetch = [_unit_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: List[Any]) -> None:
        self._nccl_unit().backward_prefetch = [
            _unit_of(m, "set_modules_to_backward_prefetch") for m in modules
        ]


class UnshardHandle:
    """`unshard(async_op=True)`'s handle: `wait()` until the parameters are gathered."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit.state is not State.SHARDED:
            with torch_stream_current(self._unit.schedule.on_cuda):
                self._unit.wait()


_CLASSES: Dict[type, type] = {}


def fully_shard(
    module: Union[torch.nn.Module, List[torch.nn.Module]],
    *,
    mesh: Any = None,
    group: Any = None,
    reshard_after_forward: Union[bool, int, None] = True,
    mp_policy: Any = None,
    offload_policy: Any = None,
    shard_placement_fn: Any = None,
) -> torch.nn.Module:
    """Shard `module`'s parameters along dim 0 (or the dim `shard_placement_fn(param)` returns
    as `Shard(dim)`; None: dim 0) over `mesh` (a 1-D torch DeviceMesh; a 2-D one
    for HSDP: replicated on dim 0, sharded on dim 1, the reduced shards all-reduced over dim 0;
    None: every rank of torch.distributed's world) or `group` (a group of ours or torch's over the ranks
    of the mesh to build). `module` may be a list of modules: one unit over all of them, gathered
    before the first of them runs forward and resharded after the last (FSDP2's grouping).
    Collective: every rank calls it for the same modules in the same order. Returns `module`,
    whose class (each module's, for a list) is now `FSDP<cls>`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    modules = _check_args(module, rank)
    found = _collect(modules, rank)
    dims = shard_dims(shard_placement_fn, found, rank)
    where = param_device(found, rank)
    check_offload(offload_policy, where.type, rank)
    mesh = mesh_for(mesh, group, rank, where.type)
    ours = ours_on(mesh, mesh.ndim - 1, rank)
    replicate = ours_on(mesh, 0, rank) if mesh.ndim == 2 else None
    device = device_for(where, ours, rank)
    reshard_after_forward = _reshard_to(reshard_after_forward, ours.size, rank)
    with torch_stream_current(device.kind == "cuda"):
        _build(modules, found, dims, mesh, ours, replicate, device, reshard_after_forward, mp_policy)
    return module


def _build(
    modules: List[torch.nn.Module],
    found: List[Tuple[str, List[Slot], Any]],
    dims: List[int],
    mesh: Any,
    ours: ProcessGroup,
    replicate: Optional[ProcessGroup],
    device: Device,
    reshard_after_forward: Optional[bool],
    policy: Any,
) -> None:
    """The unit of `modules` over `found` (their parameters, each sharded along `dims[i]`), its
    schedule and its hooks."""
    param_dtype = getattr(policy, "param_dtype", None)
    specs = [ParamSpec(tuple(p.shape), numpy_dtype(param_dtype or p.dtype), name=fqn) for fqn, _, p in found]
    check_same_params(
        specs,
        ours,
        device,
        {"reshard_after_forward": reshard_after_forward, "shard_placement_fn dims": dims},
        owner="fully_shard",
        subject=_SHARDED,
    )
    name = "+".join(type(m).__name__ for m in modules)
    schedule = Schedule(ours, device, mesh)
    layout = unit_layout(specs, ours.size, device.align_bytes, dims)
    shards = UnitShards(
        layout,
        ours,
        device,
        schedule.comm,
        schedule.scratch,
        f"fully_shard unit {name}",
        replicate=replicate,
        gathers=schedule.gathers,
    )
    params = [
        ShardedParam(i, fqn, slots, p, shards, mesh, param_dtype or p.dtype, dims[i])
        for i, (fqn, slots, p) in enumerate(found)
    ]
    reduce = getattr(policy, "reduce_dtype", None) or param_dtype
    unit = Unit(
        name,
        params,
        shards,
        schedule,
        reshard_after_forward=_check_reshard(
            True if reshard_after_forward is None else reshard_after_forward
        ),
        reduce_dtype=None if reduce is None else numpy_dtype(reduce),  # None: each parameter's dtype
    )
    for (_, _, p), sp in zip(found, params):
        setattr(p, _UNIT, name)
        sp.tag(_UNIT, name)
        sp.register(unsharded=False)
    for inner in _units_in(
        modules, recurse=True
    ):  # the root's schedule: every unit below shares its comm stream
        schedule.adopt(inner)
    schedule.units.append(unit)
    schedule.root = unit
    if reshard_after_forward is None:  # FSDP2's None: only the root keeps its parameters
        unit.reshard_after_forward, unit.reshard_unless_root = False, True
    unit.members = tuple(modules)
    for m in modules:
        setattr(m, _UNIT, unit)
        m.__class__ = _fsdp_class(type(m))
    # its comm thread ends with the module (the stream alone: the schedule holds the module)
    weakref.finalize(modules[0], schedule.comm.close)
    hooks.install(modules, unit, policy)


def _check_args(module: Any, rank: int) -> List[torch.nn.Module]:
    """The modules of the unit (`module`, or the list's), checked."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ConfigError(f"rank {rank}: fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise ConfigTypeError(
                f"rank {rank}: fully_shard takes a torch.nn.Module or a list of them, got {type(m).__name__}"
            )
        if isinstance(getattr(m, _UNIT, None), Unit):
            raise ConfigError(
                f"rank {rank}: fully_shard was applied twice to the same {type(m).__name__}: "
                "call it once per module (submodules first, then the root)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ConfigError(f"rank {rank}: fully_shard got the same module twice in its list")
    return modules


def _reshard_to(value: Union[bool, int, None], shard_size: int, rank: int) -> Optional[bool]:
    """FSDP2's int `reshard_after_forward` (the group size to reshard to after forward) as the
    bool ours runs, after torch's check (a factor of the shard group's size): 1 keeps the whole
    parameters (False), the group's size reshards (True). A size in between (torch's smaller
    post-forward mesh, not built here) reshards fully, with a warning: the same values, less
    memory held between forward and backward, the backward's gather over the whole group."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        return _check_reshard(value)  # (raises: neither a bool nor an int)
    if value < 1 or value > shard_size or shard_size % value:
        raise ConfigError(
            f"rank {rank}: fully_shard(reshard_after_forward={value}): an int is the group size to "
            f"reshard to after forward and must be a factor of the shard group's size {shard_size} "
            f"(torch's rule): pass True, False, None or a factor of {shard_size}"
        )
    if value not in (1, shard_size):
        warnings.warn(
            f"rank {rank}: fully_shard(reshard_after_forward={value}): nccl_ddp has no smaller "
            f"post-forward mesh; it reshards over all {shard_size} ranks of the shard group after "
            "forward (as True: the same results, less memory, a whole-group gather in backward)",
            stacklevel=3,
        )
    return value != 1  # (1 on a group of 1 too: False, as torch's)


def _check_reshard(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(
            f"reshard_after_forward must be True or False for nccl_ddp's fully_shard, got {value!r} "
            "(fully_shard itself also takes None, and the ints 1 and the shard group's size)"
        )
    return value


def _collect(modules: List[torch.nn.Module], rank: int) -> List[Tuple[str, List[Slot], Any]]:
    """The unit's parameters: every (fqn, slots, parameter) in the modules' trees that no sharded
    submodule holds, tied ones once (fqn: prefixed by the module's index for a list); bad ones
    are named before any data moves."""
    found: Dict[int, Tuple[str, List[Slot], Any]] = {}
    named = [
        (".".join(filter(None, [str(i) if len(modules) > 1 else "", prefix])), sub)
        for i, module in enumerate(modules)
        for prefix, sub in module.named_modules(remove_duplicate=False)
    ]
    for prefix, sub in named:
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            fqn = f"{prefix}.{pname}" if prefix else pname
            owner = getattr(p, _UNIT, None)
            if owner is not None:
                if _is_dtensor(p):
                    continue  # a sharded submodule's
                raise ConfigError(
                    f"rank {rank}: parameter {fqn!r} of {type(sub).__name__} is shared with the "
                    f"fully_shard unit {owner!r}, which already manages it: a parameter shared across "
                    "units is not supported; shard the modules that share it as one unit (apply "
                    "fully_shard to a module holding both)"
                )
            if id(p) in found:
                found[id(p)][1].append((sub, pname))
                continue
            _check_param(fqn, p, rank)
            found[id(p)] = (fqn, [(sub, pname)], p)
    return list(found.values())


def _check_param(fqn: str, p: Any, rank: int) -> None:
    from torch.nn.parameter import is_lazy

    if _is_dtensor(p):
        raise ConfigError(f"rank {rank}: parameter {fqn!r} is already a DTensor (torch's fully_shard or TP?)")
    if is_lazy(p):
        raise ConfigError(
            f"rank {rank}: parameter {fqn!r} is uninitialized (lazy): run one forward of its "
            "module (or build it with its sizes) before fully_shard"
        )
    if not p.is_contiguous():
        raise ConfigError(
            f"rank {rank}: parameter {fqn!r} is not contiguous (strides {p.stride()}): make it "
            "contiguous (p.data = p.data.contiguous()) before fully_shard"
        )
    if p.dim() == 0:
        raise ConfigError(
            f"rank {rank}: parameter {fqn!r} has no dimensions, so it cannot be sharded along dim 0: "
            "give it shape (1,) (e.g. torch.nn.Parameter(t.reshape(1)))"
        )


def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _units_in(modules: List[torch.nn.Module], recurse: bool) -> List[Unit]:
    """The units of `modules` (and of their submodules with `recurse`), each once (a unit over
    a list of modules is on each of them)."""
    found: Dict[int, Unit] = {}
    for m in modules:
        for sub in m.modules() if recurse else [m]:
            unit = getattr(sub, _UNIT, None)
            if isinstance(unit, Unit):
                found.setdefault(id(unit), unit)
    return list(found.values())


def _unit_of(module: Any, what: str) -> Unit:
    unit = getattr(module, _UNIT, None)
    if not isinstance(unit, Unit):
        raise ConfigError(f"{what}: {type(module).__name__} was not sharded by nccl_ddp.fully_shard")
    return unit


def _fsdp_class(cls: Type[Any]) -> type:
    """FSDP<cls>, one per class (torch's naming)."""
    if cls not in _CLASSES:
        fsdp_cls: Type[Any] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        fsdp_cls._orig_cls_mro_index = fsdp_cls.__mro__.index(cls)  # torch's __new__ builds a cls
        _CLASSES[cls] = fsdp_cls
    return _CLASSES[cls]
