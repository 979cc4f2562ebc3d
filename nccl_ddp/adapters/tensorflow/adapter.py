"""TensorFlow 2 adapter: `DistributedGradReducer` on `tf.Variable`s (or Keras 3 variables on the
TensorFlow backend) and `GradientTape` grads, eagerly and inside `tf.function`; the functional
collectives on tensors and variables.

Eager: every grad is read without a copy (`numpy.from_dlpack` of the EagerTensor, a read-only
view); the reducer packs it into its bucket, and each reduced grad comes back as a tensor over its
slice of the call's fresh memory the bucket is copied out into
(`tf.experimental.dlpack.from_dlpack`, zero-copy: the host backend aligns slices to 64 bytes).

Inside `tf.function` the grads are symbolic: the reduction becomes one `tf.numpy_function(...,
stateful=True)` op. At run time TensorFlow hands it the grads as NumPy arrays, the reducer
all-reduces them and TensorFlow copies the results into the graph. Stateful ops in a `tf.function`
run in program order (automatic control dependencies), never pruned or reordered, so every rank
issues its all-reduces in the same order; the cost (a copy each way and a Python call per step)
is measured in docs/benchmarks.md. XLA (`tf.function(jit_compile=True)`, Keras'
`compile(jit_compile=True)`) cannot call back into Python: refused when traced, with the way out.

TensorFlow tensors are immutable and its variables expose no writable DLPack memory, so the
functional collectives copy them in; a tensor gets a new tensor back, a variable is assigned the
result (so `nd.all_reduce(v)` updates `v`, as for a torch tensor).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, List, NoReturn, Optional, Sequence, Union

import numpy as np

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import native_view, numpy_dtype
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradsAdapter, ReduceNative
from nccl_ddp.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import tensorflow as tf

XLA_REFUSED = (
    "DistributedGradReducer was traced inside an XLA-compiled function (tf.function("
    "jit_compile=True), or Keras' model.compile(jit_compile=True)): XLA cannot call back into "
    "Python, where nccl_ddp all-reduces. Compile without XLA: tf.function(jit_compile=False), "
    "model.compile(..., jit_compile=False)"
)


def adapt(module: object) -> NoReturn:
    raise ConfigTypeError(
        "TensorFlow/Keras models have no grad hooks for DistributedDataParallel: reduce the "
        "tape's grads with nccl_ddp.DistributedGradReducer(model.trainable_variables), or wrap "
        "a Keras optimizer in nccl_ddp.keras.DistributedOptimizer for model.fit"
    )


def grads_adapter() -> TFGrads:
    return TFGrads()


def dlpack_source(x: object) -> tf.Tensor:
    """What DLPack reads for a TensorFlow object without `__dlpack__`: a variable's current
    value (a tensor: copied in by the collectives, as every immutable input)."""
    import tensorflow as tf

    if isinstance(x, tf.Variable) and tf.executing_eagerly():
        return x.read_value()
    if isinstance(x, (tf.Tensor, tf.Variable)):  # inside tf.function: no memory to exchange yet
        raise ConfigError(
            f"a symbolic {type(x).__name__} (inside tf.function) cannot go through a collective: "
            "nccl_ddp's functional collectives run on concrete values. Reduce grads with "
            "DistributedGradReducer (it bridges tf.function), or call the collective at run time: "
            "tf.numpy_function(lambda a: nd.all_reduce(a), [x], x.dtype, stateful=True)"
        )
    raise ConfigTypeError(f"cannot exchange a {type(x).__module__}.{type(x).__name__} through DLPack")


def array_from_native(native: NativeArray, like: object = None) -> Union[tf.Tensor, tf.Variable]:
    """What a collective returns to a TensorFlow caller: a variable `like` is assigned `native`
    and returned; otherwise a new tensor over `native` (zero-copy where TensorFlow can)."""
    import tensorflow as tf

    if isinstance(like, tf.Variable):
        like.assign(tensor_from_native(native))
        return like
    return tensor_from_native(native)


def tensor_from_native(native: NativeArray) -> tf.Tensor:
    """A tensor over a native (NumPy / CuPy) array, via DLPack; a copy for dtypes DLPack lacks."""
    import tensorflow as tf

    try:
        return tf.experimental.dlpack.from_dlpack(native.__dlpack__())
    except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError):
        host = native if isinstance(native, np.ndarray) else native.get()
        return tf.convert_to_tensor(host)


def to_native(x: object) -> NativeArray:
    """A native array over a TensorFlow tensor (a variable: its current value), through DLPack."""
    return native_view(x, f"a {type(x).__name__}")


from_native = tensor_from_native


def in_xla_context() -> bool:
    """Whether the function being traced is compiled by XLA."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def variable_name(v: object) -> Optional[str]:
    """How messages name a variable: Keras 3's path ("dense/kernel"), else TensorFlow's name."""
    name = getattr(v, "path", None) or getattr(v, "name", None)
    return name if isinstance(name, str) else None


class TFGrads(GradsAdapter):
    """Parameters: a list or tuple of `tf.Variable`s (or tensors); grads: tensors of the same
    shapes and dtypes (`tape.gradient(loss, variables)`), eager or symbolic."""

    def __init__(self) -> None:
        self.native_module: ModuleType = np  # the reducer's arrays (CuPy on the GPU): bind()

    def bind(self, native_module: ModuleType, group: ProcessGroup) -> None:
        self.native_module = native_module

    def param_infos(self, parameters: Sequence[tf.Variable]) -> List[ParamSpec]:
        if not isinstance(parameters, (list, tuple)) or not parameters:
            raise ConfigTypeError(
                "parameters must be a non-empty list or tuple of tf.Variables, got "
                f"{type(parameters).__name__}"
            )
        specs = []
        for i, p in enumerate(parameters):
            if frameworks.framework_of(p) not in ("tensorflow", "keras"):
                raise ConfigTypeError(
                    f"parameters[{i}] is a {type(p).__module__}.{type(p).__name__}, but "
                    f"parameters[0] is TensorFlow's: pass variables of one framework"
                )
            shape = tuple(p.shape)
            if any(d is None for d in shape):
                raise ConfigError(f"parameters[{i}] ({variable_name(p)!r}) has an unknown shape {shape}")
            specs.append(ParamSpec(tuple(int(d) for d in shape), numpy_dtype(p.dtype), variable_name(p)))
        return specs

    def leaves(self, grads: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """The grads as dense tensors, once each is a TensorFlow tensor."""
        import tensorflow as tf

        if not isinstance(grads, (list, tuple)):
            raise ConfigTypeError(f"grads must be a list or tuple of tf.Tensors, got {type(grads).__name__}")
        out = []
        for i, g in enumerate(grads):
            if g is None:
                raise ConfigError(
                    f"grads[{i}] is None: its variable got no grad from the tape (unused in the "
                    f"loss); pass tf.zeros_like(variable), or build the reducer on the variables "
                    f"that get grads"
                )
            if isinstance(g, tf.IndexedSlices):  # an embedding's sparse grad: reduced dense
                g = tf.convert_to_tensor(g)
            if not isinstance(g, (tf.Tensor, tf.Variable)):
                raise frameworks.mixed_frameworks(
                    f"grads[{i}]", g, "tensorflow", "tf.Tensors (tf.convert_to_tensor)"
                )
            out.append(g)
        return out

    def to_native(self, grads: Sequence[tf.Tensor]) -> List[NativeArray]:
        return [native_view(g, f"grads[{i}]") for i, g in enumerate(self.leaves(grads))]

    def from_native(self, grads: Sequence[tf.Tensor], reduced: Sequence[NativeArray]) -> Sequence[tf.Tensor]:
        out = [tensor_from_native(r) for r in reduced]
        return tuple(out) if isinstance(grads, tuple) else out

    def reduce(self, reduce_native: ReduceNative, grads: Sequence[tf.Tensor]) -> Sequence[tf.Tensor]:
        import tensorflow as tf

        leaves = self.leaves(grads)
        if tf.executing_eagerly() and all(hasattr(g, "__dlpack__") for g in leaves):
            return self.from_native(grads, reduce_native(self.to_native(leaves)))
        return self._reduce_in_graph(reduce_native, grads, leaves)

    def _reduce_in_graph(
        self, reduce_native: ReduceNative, grads: Sequence[tf.Tensor], leaves: List[tf.Tensor]
    ) -> Sequence[tf.Tensor]:
        """The reduction as one stateful numpy_function in the traced graph (see the module doc)."""
        import tensorflow as tf

        if in_xla_context():
            raise ConfigError(XLA_REFUSED)
        xp = self.native_module

        def on_host(*arrays: np.ndarray) -> List[np.ndarray]:
            native = [np.asarray(a) if xp is np else xp.asarray(np.asarray(a)) for a in arrays]
            return [np.asarray(r) if xp is np else xp.asnumpy(r) for r in reduce_native(native)]

        out = tf.numpy_function(
            on_host, leaves, [g.dtype for g in leaves], stateful=True, name="nccl_ddp_reduce"
        )
        for o, g in zip(out, leaves):
            o.set_shape(g.shape)
        return tuple(out) if isinstance(grads, tuple) else list(out)


if TYPE_CHECKING:  # this module is TensorFlow's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.tensorflow import adapter as _this

    _contract: FrameworkAdapter = _this
