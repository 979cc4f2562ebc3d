"""`DistributedDataParallel`: MindSpore's signature, PyTorch DDP's behaviour where MindSpore is
silent, over any framework through an adapter (`adapters/`), the reducer doing the work.

Grads accumulate across steps until `zero_grad()` (MindSpore semantics). A grad enters the
reducer through `mark_ready(param, grad=None)`, called by a framework hook (`grad_hook(i)`) or by
hand-written backprop (adapters/arrays.py); the last one finalizes the step.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ClassVar, FrozenSet, Iterator, List, Optional, Type

import numpy as np

from nccl_ddp.arrays import frameworks
from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.comm.api import device_of, resolve_group
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.ddp.config import CheckFinite, DDPConfig, GradPath, ReducerMode, config_from
from nccl_ddp.ddp.interfaces import GradModule, module_adapter
from nccl_ddp.ddp.join import JoinState
from nccl_ddp.ddp.join_participant import JoinsUnevenInputs
from nccl_ddp.ddp.param_sync import broadcast_coalesced, check_same_params
from nccl_ddp.ddp.reducer import Reducer
from nccl_ddp.device.base import Device
from nccl_ddp.errors import ConfigError, ConfigRuntimeError, ConfigTypeError, ReducerError
from nccl_ddp.validate import check_float_dtype
from nccl_ddp.zero.config import ZeroConfig

log = logging.getLogger(__name__)


class DistributedDataParallel(JoinsUnevenInputs):
    """Wraps `module`; calling the wrapper runs the module's forward and opens a step.

    For a framework whose models are objects of its own (torch.nn.Module), the wrapper is one
    too: `DistributedDataParallel(torch_model)` is an instance of the adapter's subclass
    (adapters/torch/ddp.py), which is also a torch.nn.Module. Joinable (`nccl_ddp.Join`).
    """

    reducer_class: ClassVar[Type[Reducer]] = Reducer
    """The reducer this wrapper builds: a framework's wrapper may name a subclass that adds its
    framework's reducer API (torch's `TorchReducer`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedDataParallel:
        module = args[0] if args else kwargs.get("module")
        if (
            cls is DistributedDataParallel
            and module is not None
            and not isinstance(module, (GradModule, list, tuple, dict))
        ):
            name = frameworks.framework_of(module)
            wrapper = None if name is None else frameworks.wrapper_class(name)
            if wrapper is not None:  # the framework base's own __new__ (MindSpore's Cell_)
                return wrapper.__new__(wrapper)
        return super().__new__(cls)

    def __init__(
        self,
        module: Any,
        init_sync: bool = True,
        process_group: Optional[ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        average_in_collective: bool = False,
        static_graph: bool = False,
        reducer_mode: ReducerMode = "CppReducer",
        *,
        broadcast_buffers: bool = True,
        check_finite: CheckFinite = False,
        zero: Optional[ZeroConfig] = None,
        config: Optional[DDPConfig] = None,
    ) -> None:
        self.config = config_from(
            DDPConfig,
            config,
            init_sync=init_sync,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            average_in_collective=average_in_collective,
            static_graph=static_graph,
            reducer_mode=reducer_mode,
            broadcast_buffers=broadcast_buffers,
            check_finite=check_finite,
            zero=zero,
        )
        self.module = module
        self._adapter = module if isinstance(module, GradModule) else module_adapter(module)
        self.process_group = resolve_group(process_group, "process_group")
        self.device = device_of(self.process_group)
        params = self._adapter.native_params()
        if not params and not self._adapter.reduces_unbucketed:
            raise ConfigRuntimeError(
                "module has no parameters to reduce: DistributedDataParallel is not needed when a "
                "module doesn't have any parameter that requires a gradient."
            )
        _check_native(params, self.device, "parameter", self._adapter.names, contiguous=False)
        grads = self._adapter.native_grads()
        _check_native(grads, self.device, "grad", self._adapter.names)
        install = self._adapter.install_grad if self._adapter.can_install_grads else None
        if self.config.init_sync:  # before a shard core (zero=) moves the parameters
            self._init_sync(params)
        self.reducer = self.reducer_class(
            params,
            grads,
            self.process_group,
            self.device,
            self.config,
            names=self._adapter.names,
            install=install,
            install_param=self._adapter.install_param if self._adapter.can_install_params else None,
            stream_scope=self._adapter.on_compute_stream,
            pool_grads=self._adapter.pools_grads,
            hooks=self._adapter,
        )
        self._sync_buffers_next = True  # torch: the first forward syncs buffers
        self.join_state = JoinState()
        self.reducer.on_open = self._on_step_open
        self._adapter.attach(self.reducer)  # the adapter's view: a StepDriver

    def _init_sync(self, params: List[Any]) -> None:
        """Check that every rank wraps the same parameters, frozen ones and buffers included,
        with the same settings, then give every rank rank 0's values (torch's
        _sync_module_states)."""
        state = self._adapter.named_frozen()
        if self.config.broadcast_buffers:
            state += self._adapter.named_buffers()
        _check_native(
            [a for _, a in state],
            self.device,
            "frozen parameter or buffer",
            [n for n, _ in state],
            floats_only=False,
            contiguous=False,
        )
        specs = [ParamSpec(tuple(p.shape), np.dtype(p.dtype), n) for p, n in zip(params, self._adapter.names)]
        specs += [ParamSpec(tuple(a.shape), np.dtype(a.dtype), n) for n, a in state]
        check_same_params(specs, self.process_group, self.device, self.config.rank_settings)
        with self._adapter.on_compute_stream():
            broadcast_coalesced(
                list(params) + [a for _, a in state],
                self.process_group,
                self.device,
                self.config.broadcast_chunk_bytes,
            )
        self._adapter.params_updated()

    # ------------------------------------------------------------------ the step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; the grads that follow belong to a new step."""
        self._pre_forward()
        return self._adapter.forward(*args, **kwargs)

    def _pre_forward(self) -> None:
        """Open a step; with broadcast_buffers, first give every rank rank 0's buffers when the
        previous forward was a synchronised one (torch's require_forward_param_sync: not after a
        forward under no_sync() or without grad recording)."""
        self._check_open()
        self.reducer.prepare()
        if self._sync_buffers_next and self.config.broadcast_buffers:
            self.sync_buffers()
        self._sync_buffers_next = self.reducer.sync_enabled and self._adapter.grad_enabled()

    def sync_buffers(self) -> None:
        """Overwrite every rank's buffers with rank 0's (one coalesced broadcast; inside a Join,
        the last rank's still training, as rank 0 may have joined). Every rank must call it;
        forward does when broadcast_buffers=True."""
        self._broadcast_buffers(joined=False)

    def _broadcast_buffers(self, joined: bool) -> None:
        buffers = [a for _, a in self._adapter.named_buffers()]
        if not buffers:
            return
        src = self._buffer_source(joined)
        with self._adapter.on_compute_stream():
            broadcast_coalesced(
                buffers, self.process_group, self.device, self.config.broadcast_chunk_bytes, src=src
            )
        self._adapter.buffers_updated()

    def mark_ready(self, param: Any, grad: Any = None) -> Any:
        """Parameter `param` (index, name or the parameter itself) has its grad for this step.

        With `grad`, it is added to the accumulated grad first. Returns the accumulated grad (a
        bucket view on the default fused-bucket path). The last parameter finalizes the step.
        """
        if grad is None and type(param) is int and 0 <= param < len(self.reducer.params) and not self._closed:
            return self.reducer.mark_ready(param)  # a framework hook's call, once per grad
        self._check_open()
        i = self.index_of(param)
        native = None if grad is None else self._adapter.to_native(i, grad)
        if native is not None:
            self._check_grad(i, native)
        return self.reducer.mark_ready(i, native)

    def _check_grad(self, i: int, grad: Any) -> None:
        """A grad given to mark_ready must match its parameter exactly (checked before the
        reducer sees it, so a refused grad leaves the step as it was)."""
        spec = self.reducer.specs[i]
        want = self.device.xp.__name__
        if (
            type(grad).__module__.split(".")[0] == want
            and hasattr(grad, "dtype")
            and grad.shape == spec.shape
            and grad.dtype == spec.dtype
        ):
            return  # once per grad: the common case builds no message
        name = self._adapter.names[i]
        label = f"rank {self.process_group.rank}: grad of parameter {i}" + (f" ({name!r})" if name else "")
        if type(grad).__module__.split(".")[0] != want or not hasattr(grad, "dtype"):
            raise ConfigTypeError(
                f"{label} must be a {want}.ndarray like the parameter, got "
                f"{type(grad).__module__}.{type(grad).__name__}"
            )
        if tuple(grad.shape) != spec.shape:
            raise ConfigError(f"{label} has shape {tuple(grad.shape)}, the parameter {spec.shape}")
        if grad.dtype != spec.dtype:
            raise ConfigTypeError(
                f"{label} has dtype {grad.dtype}, the parameter {spec.dtype}; cast "
                f"it first (grad.astype({str(spec.dtype)!r}))"
            )

    def grad_hook(self, param: Any) -> Callable[[Any], Any]:
        """A per-parameter hook `hook(grad) -> accumulated grad` for a framework's grad hooks."""
        i = self.index_of(param)

        def hook(grad: Any) -> Any:
            return self.mark_ready(i, grad)

        hook.__name__ = f"ddp_grad_hook_{i}"
        return hook

    def grad_hooks(self) -> List[Callable[[Any], Any]]:
        """`grad_hook(i)` for every parameter, in parameter order."""
        return [self.grad_hook(i) for i in range(len(self.reducer.params))]

    def finalize(self) -> None:
        """End the step now, the one end of a step (after backward if a param may get no grad)."""
        self.reducer.finalize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside only accumulate grads locally; the first step after reduces the sum."""
        before = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = before

    @property
    def sync_enabled(self) -> bool:
        """Whether the step opened now all-reduces (False inside `no_sync()`)."""
        return self.reducer.sync_enabled

    def untouched_last_step(self) -> FrozenSet[int]:
        """Parameters the last synchronised step left as they were: unused on every rank
        (find_unused_parameters) or excluded from the buckets (static_graph)."""
        return self.reducer.untouched_last_step()

    def zero_grad(self) -> None:
        """Zero the accumulated grads (DDP keeps accumulating across steps until this is called)."""
        self._adapter.synchronize()
        self.reducer.zero_grad()

    def close(self) -> None:
        """Wait for pending communication, stop the comm stream and remove the framework's grad
        hooks: the module can be wrapped again (in this group or another), and this wrapper
        refuses further steps. A second call does nothing."""
        if self._closed is not None:
            return
        try:
            self.reducer.close()
        finally:
            self._adapter.detach()

    @property
    def _closed(self) -> Optional[str]:
        """Why the wrapper was closed (None: open): by `close()`, or by its adapter through the
        reducer (`StepDriver.close`: a newer wrapper took the parameters)."""
        return self.reducer.closed

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ConfigError(
                f"rank {self.process_group.rank}: this DistributedDataParallel was closed "
                f"({self._closed}); wrap the module again (DistributedDataParallel(module)) to "
                "keep training it"
            )

    # ------------------------------------------------------------------ hooks, Join, checks

    def register_comm_hook(self, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future` (torch's contract; built-ins
        in `nccl_ddp.hooks`). Once, before the first step; not on the per-grad path
        (reducer_mode="PythonReducer")."""
        comm_hooks.check_hook(hook)
        r = self.reducer
        where = f"rank {self.process_group.rank}: register_comm_hook"
        if self.config.grad_path is GradPath.PER_GRAD:
            raise ConfigError(
                f'{where}: comm hooks work on buckets; use reducer_mode="CppReducer" (the default)'
            )
        if r.comm_hook is not None:
            raise ConfigError(f"{where}: a comm hook is registered already; register one hook, once")
        if r.steps or r.step.open:
            raise ConfigError(f"{where}: call it before the first forward/backward")
        r.set_comm_hook(state, hook)

    @property
    def last_step_finite(self) -> Optional[bool]:
        """check_finite: whether every grad of the last synchronised step was finite on every
        rank (None before the first step)."""
        return self.reducer.last_step_finite

    # ------------------------------------------------------------------ helpers

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped module's (`net.trainable_params()`, `model.parameters()`)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(module, name)

    @property
    def grads(self) -> List[Any]:
        """The native grad arrays, in parameter order."""
        return list(self.reducer.grads)

    def index_of(self, param: Any) -> int:
        n = len(self.reducer.params)
        if isinstance(param, (int, np.integer)) and not isinstance(param, bool):
            if 0 <= int(param) < n:
                return int(param)
            raise ReducerError(
                f"rank {self.process_group.rank}: unknown parameter index {param}; "
                f"the module has {n} parameters (0..{n - 1})"
            )
        try:
            return self._adapter.index_of(param)
        except KeyError:
            pass
        what = repr(param) if isinstance(param, str) else f"a {type(param).__name__}"
        raise ReducerError(
            f"rank {self.process_group.rank}: unknown parameter {what}; pass an index "
            f"(0..{n - 1}), a parameter name or one of the wrapped parameter objects"
        )


def _check_native(
    arrays: List[Any],
    device: Device,
    what: str,
    names: List[Optional[str]],
    *,
    floats_only: bool = True,
    contiguous: bool = True,
) -> None:
    want = device.xp.__name__
    for i, a in enumerate(arrays):
        label = f"{what} {i}" + (f" ({names[i]!r})" if names[i] else "")
        if type(a).__module__.split(".")[0] != want:
            raise ConfigTypeError(
                f"{label} is a {type(a).__module__}.{type(a).__name__}, but the process "
                f"group's backend ({device.kind}) reduces {want} arrays"
            )
        if floats_only:
            check_float_dtype(label, np.dtype(a.dtype))
        if contiguous and not a.flags.c_contiguous:
            raise ConfigError(f"{label} is not C-contiguous; collectives need contiguous arrays")
