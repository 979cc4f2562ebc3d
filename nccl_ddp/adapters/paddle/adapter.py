"""PaddlePaddle adapter (dynamic graph, CPU tensors on the host backend): `paddle.nn.Layer` for
`DistributedDataParallel`; lists of tensors for `DistributedGradReducer` and tensors in the
functional collectives go through the generic DLPack path (adapters/generic.py), with bfloat16
results handed back as Paddle's.

Tensors cross through DLPack: `numpy.from_dlpack(t.detach())` is a writable zero-copy view of a
Paddle tensor's memory, `paddle.from_dlpack(array)` a Paddle tensor over NumPy memory. Paddle's
dtypes are read from Paddle (`paddle.float32`, whose `str` is "paddle.float32"), never taken for
NumPy's; bfloat16, which NumPy's DLPack does not know, crosses as int16 and is reinterpreted with
ml_dtypes.

DDP keeps Paddle's grad semantics, as `paddle.DataParallel` does: `param.grad` is Paddle's own
tensor, it accumulates across backward calls until `optimizer.clear_grad()`, and a synchronised
step reduces what has accumulated (so `no_sync()` steps count). Paddle gives a grad tensor new
memory after `clear_grad()`, so it cannot alias our buckets: a hook that runs after Paddle has
accumulated a parameter's grad (`Tensor._register_backward_hook`, the one Paddle's own sharding
uses) copies the grad into its bucket slot and marks it ready; full buckets are all-reduced while
backward goes on, and when the step ends the reduced grads are copied back into `param.grad`
(Paddle's own `EagerReducer` also concatenates and splits: `step_ended`). Paddle has no
end-of-backward callback: with find_unused_parameters=True call `model.finalize()` after backward,
as for MindSpore; the parameters without a grad then contribute Paddle's as it is
(`before_step_end`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.adapters.generic import DLPackGrads, GenericAdapter
from nccl_ddp.arrays.dlpack import bfloat16_dtype, is_bfloat16, numpy_dtype
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradModule, StepDriver
from nccl_ddp.errors import ConfigError, ConfigTypeError


def adapt(layer: Any) -> PaddleModule:
    """The DDP adapter for a `paddle.nn.Layer`."""
    import paddle

    if not isinstance(layer, paddle.nn.Layer):
        raise ConfigTypeError(
            f"expected a paddle.nn.Layer, got {type(layer).__module__}.{type(layer).__name__}"
        )
    return PaddleModule(layer)


def grads_adapter() -> PaddleGrads:
    return PaddleGrads()


# ---------------------------------------------------------------------------------------------
# tensors <-> NumPy


def check_cpu(t: Any, where: str) -> None:
    """Paddle tensors are exchanged on the CPU (host backend) only."""
    if not t.place.is_cpu_place():
        raise ConfigError(
            f"{where} lives on {t.place}; nccl_ddp exchanges Paddle tensors on the CPU (host "
            "backend) only: move the model to the CPU (paddle.set_device('cpu')), or use torch/JAX/"
            "CuPy arrays on the GPU"
        )


def to_native(t: Any) -> np.ndarray:
    """A writable NumPy view of a CPU Paddle tensor's memory (no copy)."""
    import paddle

    t = t.detach()
    if t.dtype == paddle.bfloat16:  # NumPy's DLPack import knows no bfloat16
        return np.from_dlpack(t.view(paddle.int16)).view(bfloat16_dtype())
    return np.from_dlpack(t)


def from_native(a: NativeArray) -> Any:
    """A Paddle tensor sharing memory with the NumPy array `a` (which it keeps alive)."""
    import paddle

    if is_bfloat16(a.dtype):
        return paddle.from_dlpack(a.view(np.int16)).view(paddle.bfloat16)
    return paddle.from_dlpack(a)


def _is_tensor(x: Any) -> bool:
    import paddle

    return isinstance(x, paddle.Tensor)


# ---------------------------------------------------------------------------------------------
# DistributedDataParallel


class PaddleModule(GradModule):
    """A Layer seen by the reducer: its trainable parameters (`param.trainable`, as
    `paddle.DataParallel` picks them); the reducer's grads are our bucket memory, Paddle's grads
    are Paddle's, copied in by the grad hooks and back when a synchronised step ends."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        named = [(n, p) for n, p in layer.named_parameters() if p.trainable]
        self.names: List[Optional[str]] = [n for n, _ in named]
        self.params = [p for _, p in named]
        for n, p in named:
            check_cpu(p, f"parameter {n!r}")
        self._grads = [np.zeros(tuple(p.shape), numpy_dtype(p.dtype)) for p in self.params]
        self._driver: Optional[StepDriver] = None  # the wrapper's step (its reducer): attach()
        self._failed = False  # a hook raised in this backward: the others do nothing

    def native_params(self) -> List[Any]:
        return [to_native(p) for p in self.params]

    def native_grads(self) -> List[Any]:
        for g, p in zip(self._grads, self.params):
            if p.grad is not None:
                np.copyto(g, to_native(p.grad))
        return list(self._grads)

    @property
    def can_install_grads(self) -> bool:
        return True  # the reducer's grads may become bucket views: Paddle's are copied in and out

    def install_grad(self, i: int, view: Any) -> None:
        self._grads[i] = view

    def to_native(self, i: int, grad: Any) -> Any:
        return to_native(grad) if _is_tensor(grad) else grad

    # ---- state besides the trainable parameters. Paddle keeps BatchNorm's running statistics in
    # untrainable parameters: they count as buffers (as in torch), with the Layer's registered
    # buffers; the other untrainable parameters are frozen weights (broadcast at construction).
    def named_frozen(self) -> List[Tuple[Optional[str], Any]]:
        stats = {id(p) for _, p in self._batchnorm_stats()}
        return [
            (n, to_native(p))
            for n, p in self.layer.named_parameters()
            if not p.trainable and id(p) not in stats
        ]

    def named_buffers(self) -> List[Tuple[Optional[str], Any]]:
        named = [(n, b) for n, b in self.layer.named_buffers() if b is not None]
        return [(n, to_native(t)) for n, t in named + self._batchnorm_stats()]

    def _batchnorm_stats(self) -> List[Tuple[str, Any]]:
        from paddle.nn.layer.norm import _BatchNormBase

        return [
            (f"{prefix}.{n}" if prefix else n, p)
            for prefix, sub in self.layer.named_sublayers(include_self=True)
            if isinstance(sub, _BatchNormBase)
            for n, p in sub.named_parameters(include_sublayers=False)
            if not p.trainable
        ]

    def grad_enabled(self) -> bool:
        import paddle

        return bool(paddle.is_grad_enabled())

    def index_of(self, param: Any) -> int:
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            if p is param or (isinstance(param, str) and n == param):
                return i
        raise KeyError(param)

    def attach(self, driver: StepDriver) -> None:
        self._driver = driver
        for i, p in enumerate(self.params):
            p._register_backward_hook(self._grad_hook_for(i))

    def detach(self) -> None:
        """Make the hooks do nothing (Paddle's backward hooks cannot be removed)."""
        self._driver = None

    @property
    def driver(self) -> StepDriver:
        """The step the hooks feed (set by `attach`, gone after `detach`)."""
        if self._driver is None:
            raise ConfigError("this Paddle layer's DistributedDataParallel was closed; wrap the layer again")
        return self._driver

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._failed = False
        return self.layer(*args, **kwargs)

    def _grad_hook_for(self, i: int) -> Callable[[], None]:
        param = self.params[i]

        def hook() -> None:
            # runs once Paddle has accumulated this backward's grad into param.grad. Paddle's
            # backward does not stop at an exception raised here (it ends in a SystemError whose
            # context chain ends with ours): the hooks after a failed one touch nothing.
            driver = self._driver
            if driver is None or self._failed or param.grad is None:
                return
            try:
                np.copyto(driver.grads[i], to_native(param.grad))
                driver.mark_ready(i)  # (the last grad ends the step: step_ended)
            except BaseException:
                self._failed = True
                raise

        hook.__name__ = f"nccl_ddp_grad_ready_{i}"
        return hook

    def before_step_end(self, missing: Sequence[int]) -> None:
        """A step ends in which some parameters got no grad here: their bucket slots take Paddle's
        grad as it is (zeros where Paddle has none), this rank's contribution."""
        driver = self.driver
        for i in missing:
            g = self.params[i].grad
            if g is None:
                driver.grads[i][...] = 0
            else:
                np.copyto(driver.grads[i], to_native(g))

    def step_ended(self, synced: bool) -> None:
        """A synchronised step ended: Paddle's grads become the reduced ones (those no rank used
        keep theirs)."""
        import paddle

        if not synced:
            return
        driver = self.driver
        untouched = driver.untouched_last_step()
        for i, p in enumerate(self.params):
            if i in untouched:
                continue
            if p.grad is None:
                p.grad = paddle.to_tensor(driver.grads[i])
            else:
                np.copyto(to_native(p.grad), driver.grads[i])


# ---------------------------------------------------------------------------------------------
# DistributedGradReducer and the functional collectives: the generic DLPack path, with Paddle's
# bfloat16 handed back as Paddle's


def array_from_native(native: np.ndarray, like: Any = None) -> Any:
    """A Paddle tensor over the native array `native` (zero-copy; `like` is unused)."""
    return from_native(native)


def dlpack_source(x: object) -> None:
    """None: Paddle tensors speak `__dlpack__` themselves."""
    return None


class _Paddle(GenericAdapter):
    def array_from_native(self, native: Any, like: Any = None) -> Any:
        return from_native(native)


class PaddleGrads(DLPackGrads):
    """Parameters: Paddle parameters (`layer.parameters()`, an optimizer's); grads: a list/tuple of
    Paddle tensors (`[p.grad for p in params]`), read through DLPack without a copy. The reduced
    grads are Paddle tensors viewing the reducer's fresh bucket memory (assign them with
    `p.grad = g`, which copies)."""

    def __init__(self) -> None:
        super().__init__(_Paddle("paddle"))


if TYPE_CHECKING:  # this module is Paddle's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.paddle import adapter as _this

    _contract: FrameworkAdapter = _this
