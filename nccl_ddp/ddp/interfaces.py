"""The contract between the DDP core and a framework adapter, typed both ways: the core defines
it, so it never imports an adapter (`nccl_ddp.arrays.frameworks` loads one by name).

- `FrameworkAdapter`: what the core calls on an adapter module (`adapters/<fw>/adapter.py`, or
  `adapters/generic.GenericAdapter`); it builds the two below. Each adapter module declares itself
  one at its end, so a missing or renamed member fails mypy there.
- `GradModule`: a wrapped model, in native arrays, for `DistributedDataParallel`.
- `GradsAdapter`: one framework's parameters and grads, for `DistributedGradReducer`.
- `StepDriver`: the adapter's view of the wrapper it serves (the reducer), handed to
  `GradModule.attach`: what a framework's grad hooks call, and nothing else.
- `StepHooks`: what the driver calls back on a `GradModule` (which is one) as steps open and end.

The step lifecycle, the same for every adapter (the driver owns it; an adapter neither ends a
step another way nor infers that one ended):
- open: by the wrapper's forward, else by the step's first `mark_ready`; the driver then calls
  `GradModule.step_opened(syncs)`.
- end: in the driver only, at the `mark_ready` of the step's last expected grad or at
  `StepDriver.finalize()`, its one public end. An adapter whose framework says when backward has
  ended (torch's queued autograd callback) calls `finalize()` there; where the framework does not
  (Paddle, MindSpore), the user calls `DistributedDataParallel.finalize()` (the same) after
  backward when some grads may be missing (find_unused_parameters).
- on every path the driver calls `GradModule.before_step_end(missing)` (a synchronised step that
  ends without every grad: the adapter puts this rank's contribution of those into
  `driver.grads`), then `GradModule.step_ended(synced)` (the reduced grads can be read: an adapter
  whose framework keeps its own grad memory copies them back).
"""

from __future__ import annotations

import abc
import contextlib
from types import ModuleType
from typing import (
    Any,
    Callable,
    ContextManager,
    FrozenSet,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    cast,
)

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.frameworks import ArrayAdapter, NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigTypeError
from nccl_ddp.zero.core import ShardCore

Named = Tuple[Optional[str], NativeArray]
"""(name, writable native array) of a frozen parameter or a buffer."""

ReduceNative = Callable[[List[NativeArray]], Sequence[NativeArray]]
"""The grad reducer on a list of native grads (what `GradsAdapter.reduce` runs)."""


class StepDriver(Protocol):
    """What an adapter may call on the DDP step it feeds (implemented by `ddp.reducer.Reducer`):
    the grads' arrival, the step's end and what it left, and closing the wrapper."""

    @property
    def group(self) -> ProcessGroup:
        """The process group (its rank names this rank in messages)."""
        ...

    @property
    def grads(self) -> List[NativeArray]:
        """The native grad arrays, by parameter: bucket views the adapter copies a grad into, or
        (`GradModule.pools_grads`) the slot it hands each step's grad to before `mark_ready`."""
        ...

    @property
    def steps(self) -> int:
        """Synchronised steps finished (an adapter learns that a step ended from `step_ended`)."""
        ...

    sync_enabled: bool
    """Whether a step opened now reduces its grads (False inside `no_sync()`; an adapter that
    decides it itself, as Horovod's backward_passes_per_step, sets it)."""

    @property
    def shard_core(self) -> Optional[ShardCore]:
        """The model's shard core (built with `zero=`), or None."""
        ...

    def mark_ready(self, i: int, grad: Optional[NativeArray] = None) -> NativeArray:
        """Grad i of this step is final (`grad`: add it first); returns the accumulated grad."""
        ...

    def not_ready(self, indices: Sequence[int]) -> List[int]:
        """Those of `indices` whose grad was not marked ready in the current (or last) step."""
        ...

    def finalize(self) -> None:
        """End the step now: the one public end of a step (the framework's backward has ended).
        Nothing when no step is open (its last grad ended it already)."""
        ...

    def untouched_last_step(self) -> FrozenSet[int]:
        """Parameters the last synchronised step left as they were (unused on every rank)."""
        ...

    def zero_grad(self) -> None:
        """Zero every grad (before a backward that starts from none)."""
        ...

    def param_moved(self, i: int, view: NativeArray) -> None:
        """A shard core built elsewhere moved parameter i into its flat buffer (`view`)."""
        ...

    def close(self, why: str) -> None:
        """Close the wrapper (a newer one took the parameters): pending work is waited for,
        later steps are refused naming `why`; the adapter removes its own hooks."""
        ...


class StepHooks:
    """What the driver tells the wrapped model's adapter as its steps open and end (the
    lifecycle above); every `GradModule` is one, and each hook does nothing unless overridden."""

    def step_opened(self, syncs: bool) -> None:
        """The driver opened a step (by forward, the first grad, or again before any grad with
        a changed sync: torch's prepare_for_backward); `syncs`: whether it reduces its grads."""

    def before_step_end(self, missing: Sequence[int]) -> None:
        """A synchronised step is ending with the grads of `missing` not marked ready (found
        unused, or `finalize()` before backward was done): make each one's `driver.grads[i]` hold
        this rank's contribution (the accumulated grad, or zeros). Before any of them is reduced."""

    def step_ended(self, synced: bool) -> None:
        """The driver ended a step (on every path: the last grad, `finalize()`); `synced`: its
        grads were reduced and can be read in `driver.grads` (those of `untouched_last_step()`
        were left as they were). Nothing to do where the framework's grads are bucket views."""


NO_STEP_HOOKS = StepHooks()
"""The hooks of a driver that serves no `GradModule` (a reducer built alone, in tests)."""


class GradModule(StepHooks, abc.ABC):
    """What `DistributedDataParallel` needs from a wrapped model, in native arrays (and the
    step hooks of `StepHooks`, which the driver calls)."""

    names: List[Optional[str]]

    @abc.abstractmethod
    def native_params(self) -> List[NativeArray]:
        """Writable native arrays sharing memory with the parameters (init broadcast writes them)."""

    @abc.abstractmethod
    def native_grads(self) -> List[NativeArray]:
        """Native arrays holding the accumulated grads (zeros before the first backward)."""

    def install_grad(self, i: int, view: NativeArray) -> None:
        """Make the framework's grad of parameter i alias `view` (a bucket slice)."""
        raise NotImplementedError

    @property
    def can_install_grads(self) -> bool:
        """Whether `install_grad` works for this module (grads may become bucket views)."""
        return False

    @property
    def pools_grads(self) -> bool:
        """Whether, under ZeRO-2, the framework hands its own grad of parameter i to the reducer
        each step (`reducer.grads[i] = ...` before `mark_ready(i)`) and lets it go after the
        step: the reducer then packs into a small pool of bucket buffers and keeps no full-size
        grad memory (torch). False: the grads live in full-size buckets."""
        return False

    def install_param(self, i: int, view: NativeArray) -> None:
        """Make the framework's parameter i alias `view` (a slice of a shard core's flat
        parameter buffer, zero=), keeping its identity (torch: `p.data = view`)."""
        raise NotImplementedError

    @property
    def can_install_params(self) -> bool:
        """Whether `install_param` works; without it a shard core copies the gathered
        parameters back into `native_params()` after every step."""
        return False

    @property
    def reduces_unbucketed(self) -> bool:
        """Whether the adapter itself reduces trainable parameters kept out of `native_params()`
        (torch's sparse grads): a module with only those still needs the wrapper."""
        return False

    def to_native(self, i: int, grad: Any) -> NativeArray:
        """A native array for a grad of parameter i produced by the framework."""
        return grad

    def index_of(self, param: object) -> int:
        """The index of parameter `param` (a name or one of the framework's parameter objects;
        ints are the wrapper's); KeyError when it is none of this module's."""
        raise KeyError(param)

    def attach(self, driver: StepDriver) -> None:
        """Called once the DDP wrapper is built: install framework hooks that call the driver's
        `mark_ready` (torch, MindSpore, Paddle); nothing for raw arrays."""

    def detach(self) -> None:
        """Called when the wrapper closes: remove what `attach` installed, so the module can be
        wrapped again and this wrapper's hooks never run in another's backward."""

    def synchronize(self) -> None:
        """Wait for the framework's queued work that may still read the grads (MindSpore's
        asynchronous PyNative ops) before the reducer overwrites them."""

    def named_frozen(self) -> List[Named]:
        """(name, writable native array) of the parameters that get no grad (frozen): every rank
        starts from rank 0's, like the trainable ones."""
        return []

    def named_buffers(self) -> List[Named]:
        """(name, writable native array) of the module's buffers as they are now (a framework
        may have replaced one since the last call); broadcast_buffers sends rank 0's."""
        return []

    def params_updated(self) -> None:
        """Called after the native parameters, frozen parameters and buffers were overwritten by
        the init broadcast (immutable frameworks reload them)."""

    def buffers_updated(self) -> None:
        """Called after the arrays of the last `named_buffers()` were overwritten."""

    def grad_enabled(self) -> bool:
        """Whether a forward now records grads (torch.no_grad() forwards do not sync buffers)."""
        return True

    def on_compute_stream(self) -> ContextManager[None]:
        """Make the framework's compute stream the current one for the reducer's work."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model."""


class GradsAdapter(abc.ABC):
    """Converts one framework's parameters and grads for `DistributedGradReducer`."""

    @abc.abstractmethod
    def param_infos(self, parameters: Any) -> List[ParamSpec]:
        """One `ParamSpec` per parameter (shape, dtype, name, comm_fusion), in the order
        `to_native` lists the grads."""

    @abc.abstractmethod
    def to_native(self, grads: Any) -> List[NativeArray]:
        """The grads as native arrays (zero-copy DLPack views where the framework allows)."""

    @abc.abstractmethod
    def from_native(self, grads: Any, reduced: Sequence[NativeArray]) -> Any:
        """`reduced` (native arrays) as the framework's grads, in the structure of `grads`."""

    def bind(self, native_module: ModuleType, group: ProcessGroup) -> None:
        """Called once by the grad reducer: the module of its native arrays (NumPy or CuPy) and
        its group, for adapters that run the reduction inside a compiled graph (JAX, TensorFlow:
        the arrays they convert to, the group they poison when a callback fails)."""

    def reducer_wrapper(self) -> Optional[Callable[[Any], Any]]:
        """What `DistributedGradReducer(parameters)` returns instead of the reducer itself, as a
        function of it (MindSpore: an `nn.Cell` around it); None: the reducer itself."""
        return None

    def reduce(self, reduce_native: ReduceNative, grads: Any) -> Any:
        """Run `reduce_native` (the reducer on a native list) on `grads`; the frameworks whose
        compute stream is not CuPy's current one override this to make it current."""
        return self.from_native(grads, reduce_native(self.to_native(grads)))


class FrameworkAdapter(ArrayAdapter, Protocol):
    """What the core calls on a framework's adapter (`nccl_ddp.arrays.frameworks.adapter(name)`): the
    array members of `ArrayAdapter`, one array each way, and the builders of the two contracts
    above."""

    def to_native(self, x: Any, /) -> NativeArray:
        """A native array over one of the framework's arrays: a zero-copy view where the
        framework exports its memory (read-only where it exports it so), else a copy."""
        ...

    def from_native(self, native: NativeArray, /) -> Any:
        """A new array of the framework over `native` (zero-copy where the framework can)."""
        ...

    def adapt(self, module: Any) -> GradModule:
        """The `GradModule` of one of the framework's models; `ConfigTypeError` saying what to
        do instead where the framework has no DistributedDataParallel (JAX, TensorFlow)."""
        ...

    def grads_adapter(self) -> GradsAdapter:
        """The `GradsAdapter` of the framework's parameters and grads."""
        ...


def adapter_of(name: str) -> FrameworkAdapter:
    """The adapter of framework `name` (see `frameworks.adapter`) as the core sees it: every
    adapter module declares itself a `FrameworkAdapter` and is checked by mypy there."""
    return cast(FrameworkAdapter, frameworks.adapter(name))  # the module or a GenericAdapter


def grads_adapter_of(obj: Any) -> Optional[GradsAdapter]:
    """The `GradsAdapter` for a framework's parameters or grads (or a structure of them); None
    for NumPy / CuPy arrays."""
    name = frameworks.framework_of_leaves(obj)
    return None if name is None else adapter_of(name).grads_adapter()


def module_adapter(module: Any) -> GradModule:
    """The `GradModule` that `DistributedDataParallel` drives for `module`: an `ArrayModule` for
    a list/tuple/dict of arrays (NumPy/CuPy, or any framework's writable DLPack arrays), else the
    adapter of the module's framework."""
    if isinstance(module, (list, tuple, dict)):
        return frameworks.adapter_module("arrays", "arrays").ArrayModule(module)
    name = frameworks.framework_of(module)
    if name is None:
        raise ConfigTypeError(
            f"module must be a model of a supported framework (torch.nn.Module, MindSpore nn.Cell, "
            f"paddle.nn.Layer), an nccl_ddp ArrayModule or a list/dict of arrays, got "
            f"{type(module).__module__}.{type(module).__name__}"
        )
    return adapter_of(name).adapt(module)
