"""`DistributedGradReducer`: all-reduce a list of grads after backward (MindSpore's signature).

Grads are fused into buckets and pipelined: while bucket i is all-reduced on the comm stream,
bucket i+1 is packed on the caller's stream. Each bucket is packed into a buffer of its own
from `group.zeros`, made at the first call and reused by every later one (as torch's DDP
buckets), so the host backend all-reduces it in place in shared memory. The reduced grads are
then copied out (widened, with compress) into fresh memory and come back as views of it,
reshaped like the inputs, in a list/tuple like the input: every call's grads are its own and
never change afterwards (the adapters' zero-copy framework arrays over them rely on that, as
every adapter aliases them); the grads keep their memory alive.
Framework tensors go through their adapter (`nccl_ddp.ddp.interfaces.grads_adapter_of`) in and out via DLPack.
Every rank constructs the reducer (as in MindSpore); construction checks with one collective that
all ranks pass the same parameter shapes/dtypes, mean, degree and fusion ids (`RankMismatchError`
on every rank otherwise), and each call checks its grads against the parameters, locally.
After an all-reduce failed (a peer died), every later call raises `ReducerError` "a previous
step failed" with that error as its cause, at once.

fusion_type (MindSpore's fusion ids, here exactly):
- 0: no fusion: one all-reduce per grad.
- 1 (default): grads of the same dtype fused into buckets of up to 25 MiB (the first 1 MiB, so
  the first all-reduce starts early), filled in reverse parameter order.
- n > 1: like 1; only the id differs, which matters together with per-parameter ids.
A parameter with an int attribute `comm_fusion` uses that id instead of `fusion_type`: grads with
the same id (and dtype) share buckets, different ids never do, id 0 is never fused.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import numpy_dtype
from nccl_ddp.buckets.layout import (
    DEFAULT_CAP_BYTES,
    FIRST_CAP_BYTES,
    ParamSpec,
    assign_buckets,
    bucket_tag,
)
from nccl_ddp.comm.api import device_of, resolve_group
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.ddp.bucket_plan import param_views
from nccl_ddp.ddp.config import COMPRESS, CheckFinite, GradReducerConfig, config_from
from nccl_ddp.ddp.finite_check import FiniteCheck, require_check
from nccl_ddp.ddp.interfaces import grads_adapter_of
from nccl_ddp.ddp.join import Join, JoinHook, JoinState, ShadowJoinHook
from nccl_ddp.ddp.param_sync import check_same_params
from nccl_ddp.ddp.step_failure import StepFailure
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_float_dtype, check_positive_int


class DistributedGradReducer:
    """Callable on a list/tuple of grads (one per parameter, same shapes); returns them reduced.

    `compress="bf16"|"fp16"`: float32 buckets travel in that dtype (packed with the mean's scale
    in one launch, widened back after the all-reduce): half the bytes. `check_finite`: as DDP's
    (`last_step_finite`, or `NonFiniteGradError` with "raise"). Joinable (`nccl_ddp.Join`).

    A framework adapter may hand back its own object around the reducer instead (MindSpore: an
    `nn.Cell`, so that a compiled `construct` can call it); see `GradsAdapter.reducer_wrapper`."""

    def __new__(cls, parameters: Any = None, *args: Any, **kwargs: Any) -> Any:
        reducer = super().__new__(cls)
        adapter = grads_adapter_of(parameters) if isinstance(parameters, (list, tuple)) else None
        wrap = adapter.reducer_wrapper() if adapter is not None else None
        if wrap is None:
            return reducer
        cls.__init__(reducer, parameters, *args, **kwargs)  # Python skips it: not a cls instance
        return wrap(reducer)

    def __init__(
        self,
        parameters: Sequence[Any],
        mean: bool = True,
        degree: Optional[int] = None,
        fusion_type: int = 1,
        group: Optional[ProcessGroup] = None,
        *,
        compress: Optional[str] = None,
        check_finite: CheckFinite = False,
        config: Optional[GradReducerConfig] = None,
    ) -> None:
        self.config = config_from(
            GradReducerConfig,
            config,
            mean=mean,
            degree=degree,
            fusion_type=fusion_type,
            compress=compress,
            check_finite=check_finite,
        )
        parameters, names = _split_names(_materialize(parameters))
        # the parameters' framework: grads of another are refused, never mixed in silently
        self._framework = frameworks.framework_of_leaves(parameters)
        self._adapter, parameters = _described(parameters)
        self.compress, self.check_finite = self.config.compress, self.config.check_finite
        self.join_state = JoinState()
        self._divisor = 1
        self._calls = 0  # calls (steps) opened so far, shadowed ones too
        self.group = resolve_group(group, "group")
        self.device = device_of(self.group)
        if self._adapter is not None:  # JAX, TensorFlow inside a compiled step: the arrays, the group
            self._adapter.bind(self.device.xp, self.group)
        self.mean = self.config.mean
        self.degree = self.group.size if self.config.degree is None else self.config.degree
        self.fusion_type = self.config.fusion_type
        self.specs, fusion_ids = _param_specs(parameters, names, self.fusion_type)
        self._check_same_on_every_rank(fusion_ids)
        # the device's alignment: on the host, 64 bytes, so JAX can alias each reduced grad
        self.layout = assign_buckets(
            self.specs, DEFAULT_CAP_BYTES, FIRST_CAP_BYTES, align_bytes=self.device.align_bytes
        )
        self.comm = self.device.new_stream()
        self._wire: dict = {}  # bucket index -> its reused all-reduce buffer (_wire_buffer)
        self._failure = StepFailure(self.group.rank, "DistributedGradReducer", self.group)
        self._finite = (
            FiniteCheck(self.check_finite, self.device, self.group.rank, self.settle, self._label)
            if self.check_finite
            else None
        )

    def _check_same_on_every_rank(self, fusion_ids: list) -> None:
        """Every rank constructs the reducer: one collective now instead of wrong numbers later."""
        check_same_params(
            self.specs,
            self.group,
            self.device,
            {
                "mean": self.mean,
                "degree": self.degree,
                "compress": self.compress,
                "check_finite": self.check_finite,
                "fusion id (fusion_type or comm_fusion)": fusion_ids,
            },
            owner="DistributedGradReducer",
        )

    def __call__(self, grads: Sequence[Any]) -> Sequence[Any]:
        self._failure.check()
        if self._adapter is not None:  # framework grads: in and out through DLPack
            return self._adapter.reduce(self._reduce_native, grads)
        return self._reduce_native(grads)

    def _reduce_native(self, grads: Sequence[Any]) -> Sequence[Any]:
        """Check and reduce a list/tuple of native (NumPy / CuPy) grads."""
        self._failure.check()  # again: inside jax.jit this runs at every step, __call__ once
        if not isinstance(grads, (list, tuple)):
            raise ConfigTypeError(f"grads must be a list or tuple, got {type(grads).__name__}")
        if len(grads) != len(self.specs):
            raise ConfigError(f"got {len(grads)} grads for {len(self.specs)} parameters")
        native = [self._native(i, g) for i, g in enumerate(grads)]
        with self._failure.closes_step():  # a failed all-reduce: every later call says so
            return type(grads)(self._reduce(native))

    def reduce_bucket(self, b: int, grads: Sequence[Any]) -> list:
        """Bucket `b`'s grads (native arrays, in `layout.buckets[b].params` order) reduced, for
        callers that hand the buckets over one at a time (MindSpore's graph-mode ops). Inside a
        Join, bucket 0 opens a step: hand every bucket over, in order."""
        self._failure.check()
        if self.check_finite:
            raise ConfigError(
                f"rank {self.group.rank}: check_finite reads the flags of a whole "
                "call; reduce the grads in one call (reducer(grads)) to use it"
            )
        bucket = self.layout.buckets[b]
        native: list = [None] * len(self.specs)
        for p, g in zip(bucket.params, grads):
            native[p] = self._native(p, g)
        with self._failure.closes_step():
            out = self._reduce(native, (b,))
        return [out[p] for p in bucket.params]

    def _reduce(self, native: list, buckets: Optional[Sequence[int]] = None) -> list:
        """The native grads of `buckets` (all by default) reduced: views of fresh memory
        copied out of the reused bucket buffers, packing, all-reducing and copying out
        pipelined across the compute and comm streams."""
        if buckets is None or buckets[0] == 0:  # a call (or its first bucket) opens a step
            active = Join.notify_join_context(self) if self.join_state.config.enable else None
            self._divisor = self.degree if self.join_state.divide_by_initial or active is None else active
        scale = 1.0 / self._divisor if self.mean else 1.0
        compute = self.device.current_stream()
        flags = self._open_flags()
        out = [None] * len(native)
        done = []
        for b in range(len(self.layout.buckets)) if buckets is None else buckets:
            bucket = self.layout.buckets[b]
            buf = self.device.empty(bucket.padded, bucket.dtype)  # this call's grads: fresh
            offsets = list(bucket.offsets)
            views = param_views(bucket, buf)
            wbuf = self._wire_buffer(b)
            flag = None if flags is None else flags[b : b + 1]
            # compute: ─[pack b]─●ready b─[pack b+1]─●ready b+1─ ... ── wait(done *) ─▶
            #                      ╲                   ╲
            # comm:    ───────────wait─[all-reduce b]─wait─[all-reduce b+1]─●done
            compute.submit(
                functools.partial(kernels.pack, scale=scale, nonfinite_flag=flag),
                [native[p] for p in bucket.params],
                wbuf,
                offsets,
            )
            self.comm.wait(compute.record())
            self.group.all_reduce(wbuf, ReduceOp.SUM, stream=self.comm, tag=bucket_tag(b, bucket.nbytes))
            # out of the reused buffer (widened with compress; check_finite: what the reduction
            # handed back is flagged where it is written) into the fresh one the grads view
            self.comm.submit(functools.partial(kernels.unpack, nonfinite_flag=flag), views, wbuf, offsets)
            done.append(self.comm.record())
            for p, v in zip(bucket.params, views):
                out[p] = v.reshape(self.specs[p].shape)
        self._reduce_flags(flags)
        for ev in done:
            compute.wait(ev)
        return out

    def _wire_buffer(self, b: int) -> Any:
        """Bucket `b`'s buffer for the all-reduce, in the dtype it travels in: from
        `group.zeros` (shared memory on the host backend) at the first call, reused after. The
        next call packs into it only once the compute stream waited for this call's copy-out."""
        buf = self._wire.get(b)
        if buf is None:
            bucket = self.layout.buckets[b]
            wire = self._compression_dtype(bucket)
            buf = self.group.zeros(self.device, bucket.padded, bucket.dtype if wire is None else wire)
            self._wire[b] = buf
        return buf

    def _compression_dtype(self, bucket: Any) -> Any:
        """The dtype a bucket travels in: compress's for float32 buckets, else None (its own)."""
        wire = COMPRESS[self.compress]
        if wire is None or np.dtype(bucket.dtype) != np.float32:
            return None
        return comm_hooks.compression_dtype(wire)

    def _open_flags(self) -> Any:
        """A call (a step) opens: check_finite's fresh per-bucket flags (None without it)."""
        step, self._calls = self._calls, self._calls + 1
        return None if self._finite is None else self._finite.open(self.layout, step)

    def _reduce_flags(self, flags: Any) -> None:
        """check_finite: sum the per-bucket flags over the ranks after the buckets (one small
        all-reduce); with "raise", read them now."""
        if flags is None or self._finite is None:
            return
        self.group.all_reduce(flags, ReduceOp.SUM, stream=self.comm, tag="the non-finite flags")
        self.device.current_stream().wait(self.comm.record())
        self._finite.raise_if_flagged()

    def settle(self) -> None:
        """Wait until the call's reduced non-finite flags can be read."""
        self.comm.synchronize(self.group.timeout)
        self.device.current_stream().synchronize(self.group.timeout)

    def _label(self, i: int) -> str:
        name = self.specs[i].name
        return f"{i} ({name!r})" if name else str(i)

    @property
    def last_step_finite(self) -> Optional[bool]:
        """check_finite: whether every grad of the last call was finite on every rank (None
        before the first call); reading it waits for that call's communication."""
        require_check(self.check_finite, self.group.rank, "DistributedGradReducer")
        return None if self._finite is None else self._finite.finite()

    # ------------------------------------------------------------------ Join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return ShadowJoinHook(self, "DistributedGradReducer", kwargs)

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.group

    def join_shadow_step(self) -> None:
        """A joined rank's stand-in for one call of the ranks still reducing: the same
        all-reduces, on zeros."""
        self._failure.check()
        with self._failure.closes_step():
            flags = self._open_flags()
            for b, bucket in enumerate(self.layout.buckets):
                wire = self._compression_dtype(bucket)
                buf = self.device.zeros(bucket.padded, bucket.dtype if wire is None else wire)
                self.group.all_reduce(buf, ReduceOp.SUM, stream=self.comm, tag=bucket_tag(b, bucket.nbytes))
            if flags is not None:
                self.group.all_reduce(flags, ReduceOp.SUM, stream=self.comm, tag="the non-finite flags")
            self.comm.synchronize(self.group.timeout)

    def join_finished(self, is_last_joiner: bool) -> None:
        """Nothing to do: a grad reducer keeps no model state to hand over."""

    def _leaf(self, i: int) -> str:
        """How a message names grad i: its pytree key path (JAX), its parameter's name (MindSpore,
        torch), else its index."""
        name = self.specs[i].name
        if name is None:
            return f"grads[{i}]"
        return f"grad {name}" if name.startswith("[") else f"grad {name!r} (grads[{i}])"

    def _native(self, i: int, g: Any) -> Any:
        xp = self.device.xp.__name__
        if type(g).__module__.split(".")[0] != xp:
            raise frameworks.mixed_frameworks(
                self._leaf(i),
                g,
                self._framework or xp,
                "grads of the parameters' framework",
                f" and the {self.group.backend} group reduces {xp} arrays",
            )
        spec = self.specs[i]
        if tuple(g.shape) != spec.shape:
            raise ConfigError(
                f"{self._leaf(i)}: shape differs: the grad has {tuple(g.shape)}, its parameter {spec.shape}"
            )
        if np.dtype(g.dtype) != spec.dtype:
            raise ConfigError(
                f"{self._leaf(i)}: dtype differs: the grad is {np.dtype(g.dtype)}, "
                f"its parameter {spec.dtype}; cast the grads to the parameters' "
                f"dtypes before reducing"
            )
        return g

    def close(self) -> None:
        """Wait for pending communication (not after a failed call: its error was raised
        already) and release the comm stream."""
        if self._failure.error is None:
            self.comm.synchronize(self.group.timeout)
        self.comm.close()


def _described(parameters: Any) -> tuple:
    """(the parameters' adapter or None, the parameters as the core reads them: shape and dtype;
    torch / JAX / MindSpore parameters described natively); not a non-empty list: an error."""
    adapter = grads_adapter_of(parameters)
    if adapter is not None:
        parameters = adapter.param_infos(parameters)
    if not isinstance(parameters, (list, tuple)) or not parameters:
        raise ConfigTypeError(
            f"parameters must be a non-empty list or tuple of parameters, got {type(parameters).__name__}"
        )
    return adapter, parameters


def _param_specs(parameters: Sequence[Any], names: Optional[list], fusion_type: int) -> tuple:
    """(one ParamSpec per parameter, each one's fusion id): shape, float dtype, name and bucket
    key, a parameter's `comm_fusion` before `fusion_type` (id 0: a bucket of its own)."""
    specs, fusion_ids = [], []
    for i, p in enumerate(parameters):
        if not hasattr(p, "shape") or not hasattr(p, "dtype"):
            raise ConfigTypeError(f"parameters[{i}] has no shape/dtype: {type(p).__name__}")
        fid = getattr(p, "comm_fusion", None)
        fid = fusion_type if fid is None else fid
        check_positive_int(f"parameters[{i}].comm_fusion", fid, allow_zero=True)
        fusion_ids.append(fid)
        key = ("alone", i) if fid == 0 else fid
        dtype = _param_dtype(p, i)
        check_float_dtype(f"parameters[{i}]", dtype)
        name = names[i] if names is not None else getattr(p, "name", None)
        specs.append(ParamSpec(tuple(p.shape), dtype, name, key))
    return specs, fusion_ids


def _param_dtype(p: Any, i: int) -> np.dtype:
    try:
        return numpy_dtype(p.dtype)
    except ConfigTypeError as e:
        raise ConfigTypeError(f"parameters[{i}]: {e}") from e


def _split_names(parameters: Any) -> tuple:
    """(parameters, names) from `(name, parameter)` pairs (torch's `model.named_parameters()`),
    so messages name the parameter; (parameters, None) otherwise."""
    if (
        isinstance(parameters, (list, tuple))
        and parameters
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in parameters)
    ):
        return [p for _, p in parameters], [n for n, _ in parameters]
    return parameters, None


def _materialize(parameters: Any) -> Any:
    """A list for a one-shot iterable of parameters (torch's `model.parameters()` generator)."""
    if isinstance(parameters, (list, tuple, dict)) or hasattr(parameters, "shape"):
        return parameters
    if hasattr(parameters, "__iter__") and hasattr(parameters, "__next__"):
        return list(parameters)
    return parameters
