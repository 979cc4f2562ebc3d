"""Keras 3 adapter: `DistributedOptimizer` (model.fit with one line), the broadcast of the initial
variables and optimizer state from a root rank (a function and a callback), and
`DistributedGradReducer` on `keras.Variable`s, on any Keras 3 backend.

The grads of a Keras model are the backend's tensors, so the work goes to that backend's adapter:
TensorFlow's (eager, or a `tf.numpy_function` inside Keras' `tf.function` train step), JAX's (an
ordered `io_callback` inside Keras' jitted train step) or torch's (eager). Only this module and
those adapters import Keras and the backends.

`DistributedOptimizer(opt)` is an optimizer of `opt`'s own class (a subclass made here, built from
`opt.get_config()`) whose `apply()` all-reduces the grads first and then runs Keras' own
`apply()`: loss-scale unscaling, gradient accumulation, `clipnorm`/`clipvalue`/`global_clipnorm`
and the update all see the mean over the ranks, as on one process with the whole batch. Grads that
are None (variables the loss does not reach) are passed through untouched, as Keras does. A
`LossScaleOptimizer` around it (what `compile` builds under `mixed_float16`) skips steps on every
rank alike (loss_scale.py).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

from nccl_ddp.adapters.keras import loss_scale
from nccl_ddp.adapters.per_variables import PerVariables
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradsAdapter, ReduceNative, adapter_of
from nccl_ddp.errors import ConfigError, ConfigTypeError

_BACKENDS = ("tensorflow", "jax", "torch")


def backend() -> str:
    """Keras' backend, refused unless one nccl_ddp has an adapter for."""
    import keras

    name = keras.config.backend()
    if name not in _BACKENDS:
        raise ConfigTypeError(
            f"Keras' backend is {name!r}; nccl_ddp supports Keras 3 on {', '.join(_BACKENDS)} "
            f"(set KERAS_BACKEND before importing keras)"
        )
    return name


def adapt(module: Any) -> Any:
    raise ConfigTypeError(
        "Keras models have no DistributedDataParallel: wrap the optimizer, "
        "model.compile(optimizer=nccl_ddp.keras.DistributedOptimizer(keras.optimizers.Adam()), ...),"
        " and add nccl_ddp.keras.BroadcastGlobalVariablesCallback(0) to model.fit's callbacks"
    )


def grads_adapter() -> KerasGrads:
    return KerasGrads()


def dlpack_source(v: Any) -> Any:
    """A variable's current values, as NumPy (copied in, like every variable)."""
    import keras

    return np.array(keras.ops.convert_to_numpy(v))


def array_from_native(native: Any, like: Any = None) -> Any:
    """A collective's result for a Keras variable: assigned to it, which is returned."""
    like.assign(native if isinstance(native, np.ndarray) else native.get())
    return like


def to_native(x: Any) -> NativeArray:
    """A native array over a Keras variable's value or a tensor of Keras' backend (by the
    backend's adapter)."""
    value = x.value if frameworks.framework_of(x) == "keras" else x
    return adapter_of(backend()).to_native(value)


def from_native(native: NativeArray) -> Any:
    """A tensor of Keras' backend over `native` (by the backend's adapter)."""
    return adapter_of(backend()).from_native(native)


class KerasGrads(GradsAdapter):
    """Parameters: `keras.Variable`s; grads: the backend's tensors, given to its adapter."""

    def __init__(self) -> None:
        self.backend = backend()
        self.inner = adapter_of(self.backend).grads_adapter()

    def bind(self, native_module: ModuleType, group: ProcessGroup) -> None:
        self.inner.bind(native_module, group)

    def param_infos(self, parameters: Any) -> List[ParamSpec]:
        if not isinstance(parameters, (list, tuple)) or not parameters:
            raise ConfigTypeError(
                f"parameters must be a non-empty list of keras.Variables, got {type(parameters).__name__}"
            )
        specs = self.inner.param_infos([_backend_value(v, self.backend) for v in parameters])
        return [dataclasses.replace(s, name=_path(v) or s.name) for s, v in zip(specs, parameters)]

    def to_native(self, grads: Any) -> List[Any]:
        return list(self.inner.to_native(grads))

    def from_native(self, grads: Any, reduced: Sequence[NativeArray]) -> Any:
        return self.inner.from_native(grads, reduced)

    def reduce(self, reduce_native: ReduceNative, grads: Any) -> Any:
        return self.inner.reduce(reduce_native, grads)


def _path(v: Any) -> Optional[str]:
    path = getattr(v, "path", None)
    return path if isinstance(path, str) else None


def _name(v: Any) -> Optional[str]:
    name = getattr(v, "name", None)  # a tf.Variable's (Keras variables have a path)
    return name if isinstance(name, str) else None


def _backend_value(v: Any, name: str) -> Any:
    """What the backend adapter describes for variable `v`: its tensor (torch, TensorFlow), or
    for JAX, whose jitted steps trace the values, its shape and dtype only."""
    if frameworks.framework_of(v) != "keras":
        return v  # already the backend's (a tf.Variable, a jax.Array)
    if name == "jax":
        import jax

        # the value's dtype: without jax_enable_x64 a float64 variable holds float32
        return jax.ShapeDtypeStruct(tuple(v.shape), np.dtype(v.value.dtype))
    return v.value


# ------------------------------------------------------------------ the optimizer


class _AllReduceBeforeApply:
    """Mixed in before a Keras optimizer class: `apply()` all-reduces the grads first."""

    _nccl_ddp_settings: Dict[str, Any]
    _nccl_ddp_reducers: PerVariables

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif getattr(self, "built", False):
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = []  # Keras' own apply() says what is missing
        if len(variables) == len(grads):
            grads = self._nccl_ddp_reduce(grads, variables)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def _nccl_ddp_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """The grads reduced over the ranks (None ones untouched); a subclass may keep some local."""
        keep = [i for i, g in enumerate(grads) if g is not None]
        if keep:
            reduced = self._nccl_ddp_reducer([variables[i] for i in keep])([grads[i] for i in keep])
            for i, g in zip(keep, reduced):
                grads[i] = g
        return grads

    def _nccl_ddp_reducer(self, variables: List[Any]) -> Any:
        """The grad reducer for this set of variables (built once, on every rank at its first step)."""

        def build() -> Any:
            from nccl_ddp.ddp.grad_reducer import DistributedGradReducer

            return DistributedGradReducer(variables, **self._nccl_ddp_settings)

        return self._nccl_ddp_reducers.get(variables, None, build)


def DistributedOptimizer(
    optimizer: Any,
    *,
    mean: bool = True,
    compress: Optional[str] = None,
    fusion_type: int = 1,
    group: Any = None,
    mixin: type = _AllReduceBeforeApply,
    config: Optional[Dict[str, Any]] = None,
) -> Any:
    """A copy of the Keras 3 `optimizer` (same class and config, fresh state) whose `apply()`
    all-reduces the grads (mean over the ranks, through `DistributedGradReducer`'s buckets) before
    Keras clips, accumulates and applies them. Wrap before training: `model.compile(optimizer=
    nccl_ddp.keras.DistributedOptimizer(keras.optimizers.Adam(1e-3)), ...)`. `mixin` (a subclass
    of `_AllReduceBeforeApply`, e.g. Horovod's) and `config` (entries that replace `optimizer`'s)
    are for facades."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigTypeError(
            f"optimizer must be a Keras 3 optimizer (keras.optimizers.Adam(...)), got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        )
    if isinstance(optimizer, _AllReduceBeforeApply):
        raise ConfigError("optimizer is a DistributedOptimizer already: wrap the plain optimizer once")
    backend()
    loss_scale.install(_AllReduceBeforeApply, KerasGrads)  # a LossScaleOptimizer around it agrees
    cls = type(optimizer)
    wrapped: Any = type(cls.__name__, (mixin, cls), {"__module__": __name__})
    new = wrapped.from_config({**optimizer.get_config(), **(config or {})})
    object.__setattr__(
        new,
        "_nccl_ddp_settings",
        {"mean": mean, "compress": compress, "fusion_type": fusion_type, "group": group},
    )
    object.__setattr__(new, "_nccl_ddp_reducers", PerVariables())
    return new


# ------------------------------------------------------------------ broadcasts


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, group: Any = None) -> None:
    """Give every rank `root_rank`'s values of `variables` (Keras or TensorFlow variables): one
    broadcast per dtype, of all of that dtype's values packed together. Collective: every rank
    calls it with the same variables in the same order, which is checked first (names, shapes
    and dtypes: a `RankMismatchError` on every rank naming the first difference)."""
    import keras

    from nccl_ddp.comm import collectives
    from nccl_ddp.comm.api import device_of, resolve_group
    from nccl_ddp.ddp.param_sync import BROADCAST, check_same_params

    variables = list(variables)
    by_dtype: Dict[np.dtype, List[int]] = {}
    values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    g = resolve_group(group, "group")
    specs = [ParamSpec(a.shape, a.dtype, _path(v) or _name(v)) for a, v in zip(values, variables)]
    check_same_params(
        specs, g, device_of(g), {"root_rank": root_rank}, owner="broadcast_variables", subject=BROADCAST
    )
    for i, a in enumerate(values):
        by_dtype.setdefault(a.dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        idx = by_dtype[dtype]
        flat = np.concatenate([values[i].ravel() for i in idx]) if idx else np.empty(0, dtype)
        flat = collectives.broadcast(flat, src=root_rank, group=group)
        off = 0
        for i in idx:
            n = values[i].size
            variables[i].assign(flat[off : off + n].reshape(values[i].shape))
            off += n


def broadcast_model_and_optimizer(model: Any, root_rank: int = 0, group: Any = None) -> None:
    """Every rank starts from `root_rank`'s model variables and optimizer state: the optimizer is
    built first (its slots, iteration count and learning rate exist then) when it is not yet."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    broadcast_variables(model.variables, root_rank, group)
    if optimizer is not None:
        broadcast_variables(optimizer.variables, root_rank, group)


@functools.lru_cache(maxsize=1)
def callback_class() -> Any:
    """`BroadcastGlobalVariablesCallback`, a `keras.callbacks.Callback` subclass, made once (Keras
    is imported only when it is first asked for)."""
    import keras

    class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
        """When training starts, every rank gets `root_rank`'s model variables and optimizer state
        (`broadcast_model_and_optimizer`)."""

        def __init__(self, root_rank: int = 0, group: Any = None) -> None:
            super().__init__()
            self.root_rank, self.group = root_rank, group

        def on_train_begin(self, logs: Any = None) -> None:
            broadcast_model_and_optimizer(self.model, self.root_rank, self.group)

    BroadcastGlobalVariablesCallback.__module__ = "nccl_ddp.keras"
    return BroadcastGlobalVariablesCallback


if TYPE_CHECKING:  # this module is Keras's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.keras import adapter as _this

    _contract: FrameworkAdapter = _this
