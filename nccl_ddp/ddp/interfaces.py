"""What the DDP core asks of a framework adapter (nccl_ddp/adapters/ implements these): the core
defines the contract, so it never imports an adapter; `nccl_ddp.frameworks` picks one."""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Tuple

from nccl_ddp.buckets.layout import ParamSpec


class GradModule(abc.ABC):
    """What `DistributedDataParallel` needs from a wrapped model, in native arrays."""

    names: List[Optional[str]]

    @abc.abstractmethod
    def native_params(self) -> List[Any]:
        """Writable native arrays sharing memory with the parameters (init broadcast writes them)."""

    @abc.abstractmethod
    def native_grads(self) -> List[Any]:
        """Native arrays holding the accumulated grads (zeros before the first backward)."""

    def install_grad(self, i: int, view: Any) -> None:
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

    def install_param(self, i: int, view: Any) -> None:
        """Make the framework's parameter i alias `view` (a slice of a shard core's flat
        parameter buffer, zero=), keeping its identity (torch: `p.data = view`)."""
        raise NotImplementedError

    @property
    def can_install_params(self) -> bool:
        """Whether `install_param` works; without it a shard core copies the gathered
        parameters back into `native_params()` after every step."""
        return False

    def to_native(self, i: int, grad: Any) -> Any:
        """A native array for a grad of parameter i produced by the framework."""
        return grad

    def attach(self, ddp: Any) -> None:
        """Called once the DDP wrapper is built: install framework hooks that call its
        mark_ready (torch, MindSpore); nothing for raw arrays."""

    def detach(self) -> None:
        """Called when the wrapper closes: remove what `attach` installed, so the module can be
        wrapped again and this wrapper's hooks never run in another's backward."""

    def synchronize(self) -> None:
        """Wait for the framework's queued work that may still read the grads (MindSpore's
        asynchronous PyNative ops) before the reducer overwrites them."""

    def named_frozen(self) -> List[Tuple[Optional[str], Any]]:
        """(name, writable native array) of the parameters that get no grad (frozen): every rank
        starts from rank 0's, like the trainable ones."""
        return []

    def named_buffers(self) -> List[Tuple[Optional[str], Any]]:
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
    def to_native(self, grads: Any) -> List[Any]:
        """The grads as native arrays (zero-copy DLPack views where the framework allows)."""

    @abc.abstractmethod
    def from_native(self, grads: Any, reduced: List[Any]) -> Any:
        """`reduced` (native arrays) as the framework's grads, in the structure of `grads`."""

    def reducer_wrapper(self) -> Optional[Callable[[Any], Any]]:
        """What `DistributedGradReducer(parameters)` returns instead of the reducer itself, as a
        function of it (MindSpore: an `nn.Cell` around it); None: the reducer itself."""
        return None

    def reduce(self, reduce_native: Callable[[List[Any]], List[Any]], grads: Any) -> Any:
        """Run `reduce_native` (the reducer on a native list) on `grads`; the frameworks whose
        compute stream is not CuPy's current one override this to make it current."""
        return self.from_native(grads, reduce_native(self.to_native(grads)))
