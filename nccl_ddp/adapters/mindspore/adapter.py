"""MindSpore adapter (PyNative mode, CPU tensors on the host backend): `mindspore.nn.Cell` for
`DistributedDataParallel`, tuples of grads for `DistributedGradReducer`.

Bucket memory stays ours (NumPy); MindSpore only ever gets views of it:
- in: a grad is read through `mindspore.to_dlpack` -> `numpy.from_dlpack` (zero-copy, read-only);
- out: `Tensor.from_numpy(view)` shares the bucket's memory. (`mindspore.from_dlpack` of a NumPy
  capsule crashed MindSpore 2.10 with a segmentation fault, so the way back is `from_numpy`.)

DDP: a `Parameter.register_hook` per trainable parameter adds the grad into its bucket slot,
marks it ready and returns `Tensor.from_numpy(slot)`, so `value_and_grad` hands the optimizer
tensors that alias the buckets; the all-reduce lands there before the last hook returns. Grads
accumulate across steps until `zero_grad()` (MindSpore DDP semantics). MindSpore has no
end-of-backward callback: with find_unused_parameters=True call `net.finalize()` after
`value_and_grad`, and take the grads of parameters this rank did not use from `net.grads` (what
`value_and_grad` returns for them is MindSpore's own zeros, not the reduced grad).

Graph mode: DDP's hooks cannot run inside a compiled graph, so DDP is PyNative only (as
MindSpore's own). `DistributedGradReducer(mindspore_parameters, ...)` is an `nn.Cell` (as
MindSpore's is, `GradReducerCell`): in PyNative mode calling it runs our reducer directly; in a
compiled `construct` (GRAPH_MODE, `@jit`) its `construct` concatenates each bucket's grads in the
graph and hands them to one `ops.Custom(func_type="pyfunc")` op per bucket, which runs our
reducer's `reduce_bucket` at run time and returns the reduced grads into the graph. The bucket
ops are chained with `Depend`, so every rank issues its all-reduces in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import numpy as np

from nccl_ddp.adapters.generic import GenericAdapter
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import KDL_CPU, CapsuleHolder, bfloat16_dtype, native_from_dlpack
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.ddp.interfaces import FrameworkAdapter, GradModule, GradsAdapter, Named, StepDriver
from nccl_ddp.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import mindspore

    from nccl_ddp.ddp.grad_reducer import DistributedGradReducer


def adapt(cell: object) -> MindSporeModule:
    """The DDP adapter for a `mindspore.nn.Cell`."""
    import mindspore

    if not isinstance(cell, mindspore.nn.Cell):
        raise ConfigTypeError(
            f"expected a mindspore.nn.Cell, got {type(cell).__module__}.{type(cell).__name__}"
        )
    _require_pynative("DistributedDataParallel")
    return MindSporeModule(cell)


def grads_adapter() -> MindSporeGrads:
    return MindSporeGrads()


def array_from_native(native: NativeArray, like: object = None) -> object:
    """A collective's result for a MindSpore caller: through MindSpore's own `from_dlpack`, as
    for any framework (adapters/generic.py)."""
    return GenericAdapter("mindspore").array_from_native(native, like)


def dlpack_source(x: object) -> None:
    """None: no export besides the DLPack protocol."""
    return None


def _require_pynative(what: str) -> None:
    import mindspore

    if mindspore.get_context("mode") != mindspore.PYNATIVE_MODE:
        raise ConfigError(
            f"nccl_ddp {what} over MindSpore needs PyNative mode "
            "(mindspore.set_context(mode=mindspore.PYNATIVE_MODE)): grad hooks and "
            "Python calls cannot run inside a compiled graph"
        )


def to_native(t: mindspore.Tensor) -> np.ndarray:
    """A read-only NumPy view of a MindSpore tensor's memory, through DLPack; bfloat16, which
    NumPy's DLPack does not know ("Unsupported dtype in DLTensor"), as a NumPy copy."""
    import mindspore

    if t.dtype == mindspore.bfloat16:
        return t.asnumpy()
    return native_from_dlpack(CapsuleHolder(mindspore.to_dlpack(t)), KDL_CPU)


def from_native(a: NativeArray) -> mindspore.Tensor:
    """A MindSpore tensor sharing memory with the NumPy array `a` (which it keeps alive)."""
    from mindspore import Tensor

    return Tensor.from_numpy(a)


# MindSpore's dtypes by NumPy name (mindspore.dtype_to_nptype, deprecated since 2.7, warns at
# every call and has no public replacement)
_NUMPY_NAMES = (
    "float32",
    "float16",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool_",
    "complex64",
    "complex128",
)


def np_dtype(ms_dtype: mindspore.dtype.Type) -> np.dtype:
    """NumPy's dtype for a MindSpore dtype (bfloat16: ml_dtypes')."""
    import mindspore

    if ms_dtype == mindspore.bfloat16:
        return bfloat16_dtype()
    for name in _NUMPY_NAMES:
        if ms_dtype == getattr(mindspore, name):
            return np.dtype(name.rstrip("_"))
    raise ConfigTypeError(f"MindSpore dtype {ms_dtype} has no NumPy counterpart")


def synchronize() -> None:
    """Wait for MindSpore's queued PyNative ops (they may run asynchronously). The public
    `mindspore.runtime.synchronize` is Ascend/GPU only (on CPU it logs an error and returns), so
    this drains the PyNative executor's queue, whose `sync` is private: skipped if it is gone."""
    from mindspore.common import api

    sync = getattr(getattr(api, "_pynative_executor", None), "sync", None)
    if sync is not None:
        sync()


class MindSporeModule(GradModule):
    """A Cell seen by the reducer: its trainable parameters; grads live in our buckets."""

    def __init__(self, cell: mindspore.nn.Cell) -> None:
        self.cell = cell
        self.params = list(cell.trainable_params())
        self.names: List[Optional[str]] = [p.name for p in self.params]
        self._grads = [np.zeros(tuple(p.shape), np_dtype(p.dtype)) for p in self.params]
        self._host_params: List[np.ndarray] = []
        self._state_copies: List[Tuple[mindspore.Tensor, np.ndarray]] = []  # (tensor, copy) to write back
        self._handles: list = []

    def native_params(self) -> List[NativeArray]:
        # MindSpore exports read-only memory: the init broadcast writes copies, reloaded after
        synchronize()
        self._host_params = [np.array(to_native(p)) for p in self.params]
        return self._host_params

    def params_updated(self) -> None:
        from mindspore import Tensor

        for p, a in zip(self.params, self._host_params):
            p.set_data(Tensor(a))
        self._host_params = []
        self.buffers_updated()

    # ---- state besides the trainable parameters. MindSpore keeps BatchNorm's running statistics
    # in untrainable Parameters: they count as buffers (as in torch), with Cell.register_buffer's;
    # the other untrainable Parameters are frozen weights (broadcast at construction only).
    def named_frozen(self) -> List[Named]:
        stats = {id(p) for p in self._batchnorm_stats()}
        return self._host_copies([(p.name, p) for p in self.cell.untrainable_params() if id(p) not in stats])

    def named_buffers(self) -> List[Named]:
        return self._host_copies(
            list(self.cell.named_buffers()) + [(p.name, p) for p in self._batchnorm_stats()]
        )

    def _batchnorm_stats(self) -> List[mindspore.Parameter]:
        from mindspore.nn.layer.normalization import _BatchNorm

        return [
            p
            for _, c in self.cell.cells_and_names()
            if isinstance(c, _BatchNorm)
            for p in c.untrainable_params()
        ]

    def _host_copies(self, named: List[Tuple[Optional[str], mindspore.Tensor]]) -> List[Named]:
        """Writable copies (MindSpore exports read-only memory), written back by
        `buffers_updated`."""
        synchronize()
        copies = [(n, t, np.array(to_native(t))) for n, t in named]
        self._state_copies += [(t, a) for _, t, a in copies]
        return [(n, a) for n, _, a in copies]

    def buffers_updated(self) -> None:
        from mindspore import Parameter, Tensor

        for t, a in self._state_copies:
            if isinstance(t, Parameter):
                t.set_data(Tensor(a))
            else:
                t.assign_value(Tensor(a))
        self._state_copies = []

    def native_grads(self) -> List[NativeArray]:
        return list(self._grads)

    @property
    def can_install_grads(self) -> bool:
        return True

    def install_grad(self, i: int, view: NativeArray) -> None:
        self._grads[i] = view

    def to_native(self, i: int, grad: mindspore.Tensor) -> NativeArray:
        return to_native(grad)

    def index_of(self, param: object) -> int:
        for i, p in enumerate(self.params):
            if p is param or (isinstance(param, str) and p.name == param):
                return i
        raise KeyError(param)

    def attach(self, driver: StepDriver) -> None:
        for i, p in enumerate(self.params):
            self._handles.append(p.register_hook(self._grad_hook_for(driver, i)))

    def synchronize(self) -> None:
        synchronize()

    def forward(self, *args: object, **kwargs: object) -> object:
        synchronize()  # the last step's optimizer may still read the buckets
        return self.cell(*args, **kwargs)

    def _grad_hook_for(self, driver: StepDriver, i: int) -> Callable[[mindspore.Tensor], mindspore.Tensor]:
        def hook(grad: mindspore.Tensor) -> mindspore.Tensor:
            # the grad is added into bucket slot i; the returned tensor aliases that slot, so
            # what value_and_grad returns is the reduced grad once the step is finalized
            return from_native(driver.mark_ready(i, to_native(grad)))

        hook.__name__ = f"nccl_ddp_grad_ready_{i}"
        return hook

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class MindSporeGrads(GradsAdapter):
    """Parameters: MindSpore Parameters (an optimizer's `.parameters`); grads: a tuple/list of
    tensors. The reduced grads are tensors viewing the reducer's fresh bucket memory."""

    def param_infos(self, parameters: Sequence[mindspore.Parameter]) -> List[ParamSpec]:
        # every MindSpore Parameter has a comm_fusion (default 1); as in MindSpore's reducer,
        # they override fusion_type only when they differ
        fusion = [getattr(p, "comm_fusion", None) for p in parameters]
        if len(set(fusion)) == 1:
            fusion = [None] * len(fusion)
        return [
            ParamSpec(tuple(p.shape), np_dtype(p.dtype), getattr(p, "name", None), comm_fusion=f)
            for p, f in zip(parameters, fusion)
        ]

    def to_native(self, grads: Sequence[mindspore.Tensor]) -> List[NativeArray]:
        from mindspore import Tensor

        if not isinstance(grads, (list, tuple)):
            raise ConfigTypeError(f"grads must be a tuple or list of tensors, got {type(grads).__name__}")
        for i, g in enumerate(grads):
            if not isinstance(g, Tensor):
                raise frameworks.mixed_frameworks(f"grads[{i}]", g, "mindspore", "MindSpore tensors")
        return [to_native(g) for g in grads]

    def from_native(self, grads: object, reduced: Sequence[NativeArray]) -> Sequence[mindspore.Tensor]:
        out = [from_native(a) for a in reduced]
        return list(out) if isinstance(grads, list) else tuple(out)

    def reducer_wrapper(self) -> Optional[Callable[[DistributedGradReducer], mindspore.nn.Cell]]:
        return grad_reducer_cell


def grad_reducer_cell(reducer: DistributedGradReducer) -> mindspore.nn.Cell:
    """`reducer` (a `DistributedGradReducer` over MindSpore parameters) as an `nn.Cell`."""
    return _grad_reducer_cell_class()(reducer)


_CELL_CLASS: Optional[type] = None


def _grad_reducer_cell_class() -> type:
    """The `nn.Cell` subclass, made once on first use (MindSpore is imported lazily). Its
    `construct` uses only attributes of `self`, which MindSpore's graph compiler resolves."""
    global _CELL_CLASS
    if _CELL_CLASS is not None:
        return _CELL_CLASS
    import mindspore
    from mindspore import nn, ops

    class GradReducerCell(nn.Cell):
        """MindSpore's `DistributedGradReducer` face of our reducer: callable in PyNative mode
        and inside a compiled `construct` on a tuple of grads, one per parameter."""

        def __init__(self, reducer: DistributedGradReducer) -> None:
            super().__init__(auto_prefix=False)
            self.reducer = reducer
            self.mean, self.degree = reducer.mean, reducer.degree
            layout = reducer.layout
            buckets = layout.buckets
            # constants of the compiled graph: params per bucket, each param's (bucket, slot)
            self.bucket_params = tuple(tuple(bucket.params) for bucket in buckets)
            self.slots: tuple = tuple(layout.locate(p) for p in range(len(reducer.specs)))  # all bucketed
            self.shapes = tuple(spec.shape for spec in reducer.specs)
            self.bucket_ops = tuple(_bucket_op(reducer, b) for b in range(len(buckets)))
            self.concat = ops.Concat()
            self.reshape = ops.Reshape()
            self.depend = ops.Depend()

        def __call__(self, grads: Sequence[mindspore.Tensor], *args: object, **kwargs: object) -> object:
            if mindspore.get_context("mode") == mindspore.PYNATIVE_MODE and not (args or kwargs):
                return self.reducer(grads)  # PyNative: the reducer itself, zero-copy
            return super().__call__(grads, *args, **kwargs)

        def construct(self, grads):  # type: ignore[no-untyped-def]  # compiled by MindSpore
            if len(grads) != len(self.shapes):
                raise ValueError(f"got {len(grads)} grads for {len(self.shapes)} parameters")
            reduced = []
            previous = grads
            for params, op in zip(self.bucket_params, self.bucket_ops):
                flat = self.concat([self.reshape(grads[p], (-1,)) for p in params])
                out = op(self.depend(flat, previous))  # after the previous bucket's op
                reduced.append(out)
                previous = out
            return tuple(
                [self.reshape(reduced[b][k], shape) for (b, k), shape in zip(self.slots, self.shapes)]
            )

        def close(self) -> None:
            self.reducer.close()

    _CELL_CLASS = GradReducerCell
    return _CELL_CLASS


def _bucket_op(reducer: DistributedGradReducer, b: int) -> mindspore.ops.Custom:
    """The run-time op of bucket `b`: its grads, flat and concatenated, in; one flat reduced
    grad per parameter out. (A pyfunc must take its inputs as named parameters: MindSpore 2.10
    packs extra inputs of a `*args` function into a tuple it then rejects.)"""
    from mindspore import ops

    bucket = reducer.layout.buckets[b]
    shapes = [reducer.specs[p].shape for p in bucket.params]
    bounds = np.cumsum([0, *bucket.numels])

    def reduce_bucket(flat: np.ndarray) -> tuple:
        grads = [flat[lo:hi].reshape(shape) for lo, hi, shape in zip(bounds, bounds[1:], shapes)]
        return tuple(g.reshape(-1) for g in reducer.reduce_bucket(b, grads))

    reduce_bucket.__name__ = f"nccl_ddp_reduce_bucket_{b}"
    dtype = _ms_dtype(bucket.dtype)
    return ops.Custom(
        reduce_bucket,
        out_shape=[[int(n)] for n in bucket.numels],
        out_dtype=[dtype] * len(bucket.params),
        func_type="pyfunc",
    )


def _ms_dtype(dtype: np.dtype) -> mindspore.dtype.Type:
    """MindSpore's float type for a NumPy dtype (the reducer accepts float dtypes only)."""
    import mindspore

    for t in (mindspore.float16, mindspore.float32, mindspore.float64):
        if np_dtype(t) == dtype:
            return t
    raise ConfigTypeError(f"no MindSpore float type for {dtype}")


if TYPE_CHECKING:  # this module is MindSpore's FrameworkAdapter: mypy checks every member here
    from nccl_ddp.adapters.mindspore import adapter as _this

    _contract: FrameworkAdapter = _this
