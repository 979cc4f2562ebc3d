"""The toyfw adapter: `nccl_ddp.ddp.interfaces.FrameworkAdapter` as module functions, for toyfw's
models in `DistributedDataParallel` and its parameters in `DistributedGradReducer`.

toyfw keeps its grads in memory of its own (a new `Tensor` at each first accumulation), as Paddle
does: a parameter's grad hook copies the grad into its slot of `driver.grads` and marks it ready;
toyfw says when backward has ended (`queue_callback`), and the adapter ends the step there with
`driver.finalize()`. The step hooks do the rest: `before_step_end` puts this rank's grad (or
zeros) in the slots of the parameters that got none, `step_ended` copies the reduced grads back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import numpy as np
import toyfw

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradModule, GradsAdapter, StepDriver
from nccl_ddp.errors import ConfigTypeError
from nccl_ddp.frameworks import NativeArray


def adapt(module: Any) -> ToyModule:
    if not isinstance(module, toyfw.Module):
        raise ConfigTypeError(f"expected a toyfw.Module, got {type(module).__name__}")
    return ToyModule(module)


def grads_adapter() -> ToyGrads:
    return ToyGrads()


def to_native(x: Any, /) -> NativeArray:
    return x.numpy()  # toyfw's memory itself


def from_native(native: NativeArray, /) -> toyfw.Tensor:
    return toyfw.Tensor(native)  # over the native array, no copy


def array_from_native(native: NativeArray, like: object = None) -> toyfw.Tensor:
    return from_native(native)


def dlpack_source(x: object) -> None:
    return None  # nccl_ddp's collectives read toyfw tensors through to_native only


class ToyModule(GradModule):
    def __init__(self, module: toyfw.Module) -> None:
        self.module = module
        named = module.named_parameters()
        self.names: List[Optional[str]] = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._grads = [np.zeros(p.shape, p.dtype) for p in self.params]
        self._driver: Optional[StepDriver] = None
        self._handles: list = []
        self._queued = False

    def native_params(self) -> List[NativeArray]:
        return [to_native(p) for p in self.params]

    def native_grads(self) -> List[NativeArray]:
        return self._grads  # ours, packed into the buckets (no install_grad: toyfw's are copied in)

    def to_native(self, i: int, grad: Any) -> NativeArray:
        return to_native(grad)

    def index_of(self, param: object) -> int:
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            if p is param or n == param:
                return i
        raise KeyError(param)

    def attach(self, driver: StepDriver) -> None:
        self._driver = driver
        self._handles = [p.register_grad_hook(self._hook_for(driver, i)) for i, p in enumerate(self.params)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._driver = [], None

    def _hook_for(self, driver: StepDriver, i: int) -> Callable[[toyfw.Tensor], None]:
        def hook(p: toyfw.Tensor) -> None:
            if not self._queued:  # the first grad of a backward: end the step when it is done
                self._queued = True
                toyfw.queue_callback(self._end_of_backward)
            assert p.grad is not None
            np.copyto(driver.grads[i], to_native(p.grad))
            driver.mark_ready(i)

        return hook

    def _end_of_backward(self) -> None:
        self._queued = False
        if self._driver is not None:
            self._driver.finalize()  # (nothing when the last grad ended the step already)

    def before_step_end(self, missing: Sequence[int]) -> None:
        assert self._driver is not None
        for i in missing:
            g = self.params[i].grad
            self._driver.grads[i][...] = 0 if g is None else to_native(g)

    def step_ended(self, synced: bool) -> None:
        if not synced or self._driver is None:
            return
        untouched = self._driver.untouched_last_step()
        for i, p in enumerate(self.params):
            if i not in untouched:
                p.grad = toyfw.Tensor(np.array(self._driver.grads[i]))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ToyGrads(GradsAdapter):
    def param_infos(self, parameters: Any) -> List[ParamSpec]:
        return [ParamSpec(tuple(p.shape), np.dtype(p.dtype), p.name) for p in parameters]

    def to_native(self, grads: Any) -> List[NativeArray]:
        return [to_native(g) for g in grads]

    def from_native(self, grads: Any, reduced: Sequence[NativeArray]) -> Any:
        return [from_native(r) for r in reduced]


if TYPE_CHECKING:  # this module is toyfw's FrameworkAdapter: mypy checks every member here
    from toyfw_nccl import adapter as _this

    _contract: FrameworkAdapter = _this
