"""The parts of torch 2.13's FSDP2 surface that `fully_shard`'s units answer apart from the
unit work: `register_fsdp_forward_method` (ours, and torch's when called on our modules, which
reaches the unit through `_get_fsdp_state()`), and the `FSDPModule` methods ours refuses by
name or accepts because ours already behaves as they ask. Without these, torch's own method
would run on a module that has no torch FSDPState."""

from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn, Set

from nccl_ddp.adapters.torch.fsdp import hooks
from nccl_ddp.adapters.torch.fsdp.unit import Unit
from nccl_ddp.errors import ConfigError


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. `generate`, a ViT's `forward_features`) run the unit's
    pre- and post-forward as `forward` does: parameters gathered before it, resharded after
    (with `reshard_after_forward`), the output hooked for backward. A module no `fully_shard`
    sharded is left as it is (torch's rule); one sharded by torch's goes to torch's function."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    if not isinstance(module, TorchFSDPModule):
        return
    if not is_ours(module):
        from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

        torch_register(module, method_name)
        return
    if not callable(getattr(module, method_name, None)):
        raise ConfigError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}"
        )
    method: Callable[..., Any] = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        return hooks.run_as_forward(module, method, args, kwargs)

    setattr(module, method_name, as_forward)


def is_ours(module: Any) -> bool:
    return hasattr(module, hooks.FORWARD_HOOKS)


class TorchStateView:
    """What `_get_fsdp_state()` returns on our modules: torch's module-level functions that
    run a unit's forward hooks (its `register_fsdp_forward_method`) find them here, and
    `_modules_to_run_forward` is our unit's; any other attribute of torch's FSDPState is a
    ConfigError naming it."""

    def __init__(self, module: Any, unit: Unit) -> None:
        self._module, self._unit = module, unit

    @property
    def _modules_to_run_forward(self) -> Set[Any]:
        """The modules of a grouped unit still to run forward in this pass (torch's name for
        the same state; empty between passes and for a one-module unit)."""
        return {m for m in self._unit.members if id(m) in self._unit.to_run}

    def _pre_forward(self, module: Any, args: tuple, kwargs: dict) -> Any:
        return hooks.forward_hooks(module)[0](module, args, kwargs)

    def _post_forward(self, module: Any, args: tuple, output: Any) -> Any:
        return hooks.forward_hooks(module)[1](module, args, output)

    def __getattr__(self, name: str) -> NoReturn:
        raise ConfigError(
            f"{type(self._module).__name__} was sharded by nccl_ddp.fully_shard, which has no torch "
            f"FSDPState: its {name!r} does not exist (a torch-private FSDP2 internal; use the "
            "FSDPModule methods or torch's fully_shard)"
        )


def _refuse(method: str, why: str) -> NoReturn:
    raise NotImplementedError(f"FSDPModule.{method} is not supported by nccl_ddp's fully_shard: {why}")


class TorchOnlyMethods:
    """torch FSDPModule methods for torch's own comm machinery: refused by name (what to do
    instead in the message), or accepted where ours already does what the argument asks."""

    def set_custom_all_gather(self, comm: Any) -> None:
        _refuse(
            "set_custom_all_gather",
            "the all-gathers are ours (our process group on our comm stream); use torch's "
            "fully_shard for a custom all-gather",
        )

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _refuse(
            "set_custom_reduce_scatter",
            "the reduce-scatters are ours (our process group on our comm stream); use torch's "
            "fully_shard for a custom reduce-scatter",
        )

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        _refuse(
            "set_all_reduce_hook",
            "the reduced shards are installed as the DTensor grads at the end of backward; "
            "process the parameters' .grad after backward instead",
        )

    def set_gradient_divide_factor(self, factor: float) -> None:
        _refuse(
            "set_gradient_divide_factor",
            "grads are averaged over the mesh's ranks; to divide the sum by another factor, "
            "scale each parameter's .grad after backward by world_size / factor",
        )

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        _refuse("set_reduce_scatter_divide_factor", "(torch's deprecated name of set_gradient_divide_factor)")

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """False (torch's default) is accepted: ours picks its reduction itself."""
        if enable:
            _refuse(
                "set_force_sum_reduction_for_comms",
                "our group reduces with its own average op; leave it False",
            )

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """False (torch's default) is accepted. True is refused: ours reduce-scatters zeros for
        a parameter of the unit that has no grad on this rank, but installs the reduced rows
        only where the rank's backward reached the parameter."""
        if reduce_scatter_unused_params:
            _refuse(
                "set_reduce_scatter_unused_params",
                "a parameter without a grad on this rank gets no sharded grad here even where "
                "other ranks' reduced rows are nonzero; use the parameter on every rank (e.g. "
                "add 0 * param.sum() to the loss)",
            )

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Checked as torch's and accepted: ours packs the grads on the comm stream into its own
        scratch buffer, so the compute stream never waits to reuse a reduce-scatter input."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise ConfigError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ConfigError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """False (one group for gathers and reduce-scatters) is what ours does: accepted."""
        if enable:
            _refuse(
                "set_separate_reduce_scatter_group",
                "every collective of a root's units runs in issue order on one comm stream of one group",
            )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """False is what ours does (its buffers come from our device layer): accepted."""
        if enable:
            _refuse(
                "set_allocate_memory_from_process_group_for_comm",
                "the comm buffers come from our group's device memory, not a torch ProcessGroup",
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _refuse("set_symm_mem_for_comm", "our NCCL calls do not use torch's symmetric memory")
