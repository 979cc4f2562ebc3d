"""Horovod's torch `DistributedOptimizer`, its gradients reduced through nccl_ddp's buckets.

Horovod registers a hook per parameter and all-reduces each grad as it is produced (its runtime
fuses what arrives together). Here the hooks are the torch DDP adapter's: each grad lands in a
bucket of our reducer (a bucket view becomes `p.grad`), full buckets are all-reduced on the comm
stream while backward goes on, and the end of backward waits for them: fusion, overlap and fp16
compression are the reducer's (its fused kernels where the op allows). Horovod's semantics kept:
- the N-th backward of `backward_passes_per_step=N` reduces the grads accumulated by the N;
  `step()`/`synchronize()` before the N-th reduces what has accumulated so far;
- parameters that got no grad in a reducing backward are reduced as zeros (their `.grad` becomes
  the averaged tensor, as Horovod's `synchronize` makes it);
- a further backward before `step()`, and `zero_grad()` between backward and `step()`, raise.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch

import nccl_ddp as nd
from nccl_ddp.adapters.torch.adapter import TorchModule
from nccl_ddp.adapters.torch.tensors import torch_stream_current
from nccl_ddp.errors import ConfigError, ConfigTypeError, RankMismatchError, ReducerError
from nccl_ddp.horovod.common import (
    OP_NAMES,
    Average,
    allgather_object,
    check_scale,
    fusion_threshold_mb,
    resolve_op,
)
from nccl_ddp.horovod.compression import Compressor
from nccl_ddp.horovod.process_sets import ProcessSet, global_process_set, group_of
from nccl_ddp.horovod.torch.exchange import sparse_allreduce_async
from nccl_ddp.horovod.torch.ops import Compression, allreduce_

_TOO_MANY = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ZERO_GRAD = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_ND_OPS = {
    Average: nd.ReduceOp.SUM,
    1: nd.ReduceOp.SUM,
    3: nd.ReduceOp.MIN,
    4: nd.ReduceOp.MAX,
    5: nd.ReduceOp.PROD,
}


class _OptimizerGrads(TorchModule):
    """The DDP adapter over an optimizer's parameters: no forward, so each backward's first
    grad hook opens the step; it counts backward passes and reduces on the N-th."""

    def __init__(self, holder: Any, names: List[str], passes_per_step: int) -> None:
        super().__init__(holder)
        self.names = list(names)
        self.passes_per_step = passes_per_step
        self.passes = 0  # backward passes accumulated since the last reduction
        self.reduced = False  # a reduction that step()/synchronize() has not consumed yet
        self.sparse: Dict[int, torch.Tensor] = {}  # sparse grads (embeddings), reduced apart

    def _adopt_grad(self, i: int, p: torch.Tensor) -> None:
        """A sparse grad (nn.Embedding(sparse=True)) stays out of the buckets: kept (summed over
        accumulated passes) for its own reduction at synchronize; its bucket slot reduces zeros."""
        g = p.grad
        if g is not None and g.is_sparse:
            kept = self.sparse.get(i)
            self.sparse[i] = g if kept is None else kept + g
            self._grads[i].zero_()
            p.grad = None
            return
        super()._adopt_grad(i, p)

    def _queue_end_of_backward(self) -> None:
        if self.reduced:
            raise ReducerError(f"rank {self.group.rank}: {_TOO_MANY}")
        self.driver.sync_enabled = self.passes + 1 >= self.passes_per_step
        super()._queue_end_of_backward()

    def _end_of_backward(self) -> None:
        self._callback_queued = self._forward_opened = False
        syncing = self._syncing
        with torch_stream_current(self.on_cuda):
            if syncing:
                reducer = self.driver
                for i in reducer.not_ready(range(len(self.params))):
                    self._take_grad(i)
                    reducer.mark_ready(i)
            self.driver.finalize()
        self.passes = 0 if syncing else self.passes + 1
        self.reduced = self.reduced or syncing

    def _take_grad(self, i: int) -> None:
        """Grad i into its bucket view: zeros when it has none (Horovod reduces zeros)."""
        p, mine = self.params[i], self._grads[i]
        g = p.grad
        if i in self.sparse:
            return
        if g is not None and g.is_sparse:
            self._adopt_grad(i, p)
            return
        if g is None:
            mine.zero_()
        elif g.data_ptr() != mine.data_ptr():
            mine.copy_(g)
        p.grad = mine

    def reduce_now(self) -> None:
        """synchronize() before the N-th backward: reduce what has accumulated."""
        reducer = self.driver
        reducer.sync_enabled = True
        with torch_stream_current(self.on_cuda):
            for i in range(len(self.params)):
                self._take_grad(i)
                reducer.mark_ready(i)
        self.passes, self.reduced = 0, True


def _bucket_hook(op: int, prescale: float, postscale: float, fp16: bool) -> Any:
    """A comm hook doing Horovod's op on a bucket: pre-scale, reduce, post-scale (in float16
    on the wire with fp16 compression)."""
    nd_op = _ND_OPS[op]

    def hook(state: Any, bucket: Any) -> Any:
        group = bucket.process_group
        buf = bucket.buffer()
        wire = buf.astype(np.float16) if fp16 and buf.dtype != np.float16 else buf
        if prescale != 1.0:
            wire *= wire.dtype.type(prescale)
        post = postscale / group.size if op == Average else postscale

        def done(fut: Any) -> Any:
            out = fut.value()
            if post != 1.0:
                out *= out.dtype.type(post)
            if out is not buf:
                buf[...] = out.astype(buf.dtype)
            return buf

        return nd.hooks.all_reduce_fut(group, wire, nd_op).then(done)

    hook.__name__ = f"horovod_{OP_NAMES[op].lower()}_hook"
    return hook


class _GradSync:
    """An nccl_ddp DistributedDataParallel over the optimizer's parameters (no broadcast at
    construction: Horovod leaves that to broadcast_parameters)."""

    def __init__(
        self,
        params: List[Any],
        names: List[str],
        compression: Any,
        passes: int,
        op: int,
        predivide: float,
        process_set: ProcessSet,
        sparse_as_dense: bool,
    ) -> None:
        group = group_of(process_set, "DistributedOptimizer")
        self.names, self.op, self.process_set = names, op, process_set
        self.sparse_as_dense = sparse_as_dense
        holder = torch.nn.Module()
        for i, p in enumerate(params):
            holder.register_parameter(f"p{i}", p)
        self.grads = _OptimizerGrads(holder, names, passes)
        self.ddp = nd.DistributedDataParallel(
            self.grads,
            init_sync=False,
            process_group=group,
            bucket_cap_mb=fusion_threshold_mb(),
            broadcast_buffers=False,
        )
        fp16 = compression is Compression.fp16
        if op == Average and predivide == 1.0:
            if fp16:  # fused into our pack/unpack kernels
                self.ddp.register_comm_hook(None, nd.hooks.fp16_compress)
        else:
            pre, post = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
            self.ddp.register_comm_hook(None, _bucket_hook(op, pre, post, fp16))

    @property
    def pending(self) -> bool:
        return self.grads.passes > 0 or self.grads.reduced

    def synchronize(self) -> None:
        if not self.grads.reduced and self.grads.passes > 0:
            self.grads.reduce_now()
        self.grads.reduced = False
        self._reduce_sparse()

    def _reduce_sparse(self) -> None:
        """Horovod's sparse grads: gathered indices and values (the sum, Average divided), or
        with sparse_as_dense the dense allreduce made sparse again."""
        kept, self.grads.sparse = self.grads.sparse, {}
        for i in sorted(kept):
            p, name = self.grads.params[i], f"sparse.{self.names[i]}"
            if self.sparse_as_dense:
                dense = kept[i].to_dense().contiguous()
                p.grad = allreduce_(dense, name=name, op=self.op, process_set=self.process_set).to_sparse()
            else:
                p.grad = sparse_allreduce_async(kept[i], name, self.op, self.process_set)()


class _DistributedOptimizer:
    """Mixed in before the user's optimizer class (as Horovod builds its optimizer)."""

    def __init__(
        self,
        params: List[Dict[str, Any]],
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        sparse_as_dense: bool = False,
    ) -> None:
        super().__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        groups = self.param_groups  # type: ignore[attr-defined]
        everything = [v for g in groups for v in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
        else:  # Horovod's names: one counter over every param group
            named = [(f"allreduce.noname.{i}", v) for i, v in enumerate(everything)]
        if any(not isinstance(p, tuple) for p in named):
            raise ConfigTypeError(
                "DistributedOptimizer: named_parameters should be a sequence of tuples (name, parameter), "
                "usually produced by model.named_parameters()"
            )
        names = [k for k, _ in named]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ConfigError(
                "DistributedOptimizer: parameter names in named_parameters must be unique; "
                f"duplicates: {dups}"
            )
        name_of = {id(v): k for k, v in named}
        self._parameter_names = {v: name_of[id(v)] for v in everything if id(v) in name_of}
        trained = [p for p in everything if p.requires_grad]
        unnamed = [i for i, p in enumerate(trained) if id(p) not in name_of]
        if unnamed:
            raise ConfigError(
                f"DistributedOptimizer: named_parameters was specified, but {len(unnamed)} of the "
                f"optimizer's parameters (positions {unnamed[:10]}) are not named in it; "
                "pass model.named_parameters()"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._synchronized = False
        self._should_synchronize = True
        self._sync: Optional[_GradSync] = None
        if not process_set.included():
            return  # Horovod's: a rank outside the set trains on its own grads
        group = group_of(process_set, "DistributedOptimizer")
        if group.size > 1 and trained:
            trained.sort(key=lambda p: name_of[id(p)])  # every rank lays its buckets out by name
            _check_same_parameters(trained, name_of, process_set)
            self._sync = _GradSync(
                trained,
                [name_of[id(p)] for p in trained],
                compression,
                backward_passes_per_step,
                op,
                gradient_predivide_factor,
                process_set,
                sparse_as_dense,
            )

    def set_backward_passes_per_step(self, passes: int) -> None:
        _check_passes(passes)
        self.backward_passes_per_step = passes
        if self._sync is not None:
            self._sync.grads.passes_per_step = passes

    def synchronize(self) -> None:
        """Finish the reduction of the grads (reduce what has accumulated if the N-th backward
        has not run yet)."""
        if self._sync is not None:
            self._sync.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`optimizer.synchronize(); clip...; with optimizer.skip_synchronize(): optimizer.step()`."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._sync is not None and self._sync.pending:
            raise ReducerError(f"rank {nd.get_rank()}: {_ZERO_GRAD}")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: Any) -> None:
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)  # type: ignore[misc]


def _check_same_parameters(
    trained: List[torch.Tensor], name_of: Dict[int, str], process_set: ProcessSet
) -> None:
    """Every member names the same parameters with the same shapes and dtypes (grads are matched
    by name, as Horovod's); else a RankMismatchError on every rank naming the differences."""
    mine = [(name_of[id(p)], tuple(p.shape), str(p.dtype)) for p in trained]
    gathered = allgather_object(mine, name="DistributedOptimizer.parameters", process_set=process_set)
    everyone: List[List[Tuple[str, Tuple[int, ...], str]]] = gathered  # type: ignore[assignment]
    first = everyone[0]
    if all(other == first for other in everyone):
        return
    ranks = process_set.ranks
    diffs = []
    for r, other in zip(ranks[1:], everyone[1:]):
        a, b = {n: rest for n, *rest in first}, {n: rest for n, *rest in other}
        only0, only_r = sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5]
        shapes = [(n, a[n], b[n]) for n in sorted(set(a) & set(b)) if a[n] != b[n]][:5]
        if only0 or only_r or shapes:
            diffs.append(f"rank {r}: lacks {only0}, adds {only_r}, differs in {shapes}")
    raise RankMismatchError(
        f"rank {nd.get_rank()}: DistributedOptimizer: the ranks' parameters differ from rank "
        f"{ranks[0]}'s ({'; '.join(diffs)}); every rank must build the same model and pass the "
        "same named_parameters (grads are matched by name)"
    )


def _check_passes(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(
            f"DistributedOptimizer: backward_passes_per_step must be an int >= 1, got {passes!r}"
        )


def DistributedOptimizer(
    optimizer: Any,
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Horovod's wrapper: an optimizer of the same class (built from `optimizer.param_groups`)
    whose grads are averaged (or reduced by `op`) over the ranks before `step()` applies them."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigTypeError(
            f"DistributedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    op = resolve_op(op, None, "DistributedOptimizer")
    predivide = check_scale("DistributedOptimizer", "gradient_predivide_factor", gradient_predivide_factor)
    if predivide <= 0:
        raise ConfigError(f"DistributedOptimizer: gradient_predivide_factor must be > 0, got {predivide}")
    if predivide != 1.0 and op != Average:
        raise ConfigError("DistributedOptimizer: gradient_predivide_factor not supported with op != Average")
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigError(
            "DistributedOptimizer: compression must be hvd.Compression.none or hvd.Compression.fp16, "
            f"got {compression!r}"
        )
    if num_groups or groups is not None:
        raise ConfigError(
            "DistributedOptimizer: num_groups/groups are not supported: grads are fused into buckets of "
            "HOROVOD_FUSION_THRESHOLD bytes (25 MiB by default) in the order they are produced"
        )
    _check_passes(backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        predivide,
        process_set,
        sparse_as_dense,
    )
