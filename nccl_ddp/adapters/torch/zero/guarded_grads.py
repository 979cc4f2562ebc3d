"""`p.grad` under ZeRO-2: this rank's local grad, guarded so torch's tools cannot read it as the
averaged one.

Under ZeRO-2 the averaged grads exist only as each rank's reduced shard; after a synchronised
backward `p.grad` is a placeholder of the parameter's shape without grad-sized memory, inside
`no_sync()` torch's local sum (adapters/torch/pooled_grads.py). After every backward each `p.grad`
becomes a `LocalGrad`: the same memory (autograd keeps accumulating into it in C++, which
`__torch_function__` does not see), whose
Python-level use raises `ShardedGradError` naming `opt.clip_grad_norm_`, except:
- metadata (dtype, device, shape, data_ptr, ...), zeroing (`zero_grad(set_to_none=False)`) and
  moving or casting the module (`module.to/cpu/half`: the moved grad stays guarded);
- GradScaler's unscale-and-check (`torch._amp_foreach_non_finite_check_and_unscale_`), routed to the
  optimizer: it unscales the reduced shards and sets `found_inf` when any rank's shard is
  non-finite (one all-reduce), so every rank skips the same steps and keeps the same scale.
So `torch.nn.utils.clip_grad_norm_(model.parameters())` raises instead of clipping local values.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

import torch

from nccl_ddp.errors import ShardedGradError

_T = torch.Tensor
_ALLOWED = {
    _T.data_ptr,
    _T.size,
    _T.dim,
    _T.numel,
    _T.zero_,
    _T.detach_,
    _T.requires_grad_,
    _T.is_floating_point,
    _T.is_complex,
    _T.share_memory_,
    _T.data.__set__,
    torch._foreach_zero_,
    torch._has_compatible_shallow_copy_type,
    *(
        getattr(_T, name).__get__
        for name in (
            "dtype",
            "device",
            "shape",
            "ndim",
            "layout",
            "is_sparse",
            "is_cuda",
            "requires_grad",
            "grad_fn",
            "is_leaf",
        )
    ),
}
# moving or casting the module (module.to/cpu/half/...) moves its grads: the result stays guarded
_CONVERT = {_T.to, _T.cpu, _T.cuda, _T.float, _T.half, _T.bfloat16, _T.double}
_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_


class LocalGrad(torch.Tensor):
    """A `.grad` holding this rank's local grad under ZeRO-2 (see the module docstring)."""

    _nd_opt: Callable[[], Any]

    @classmethod
    def wrap(cls, grad: torch.Tensor, opt: Any) -> LocalGrad:
        """The same memory as `grad`, guarded; `opt` (weakly held) handles GradScaler."""
        out = torch.Tensor._make_subclass(cls, grad)
        out._nd_opt = weakref.ref(opt)
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _CONVERT:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            opt = args[0]._nd_opt()
            if out is args[0] or not isinstance(out, torch.Tensor) or opt is None:
                return out
            return LocalGrad.wrap(out, opt)
        if func is _UNSCALE:
            return _unscale(*args, **kwargs)
        raise ShardedGradError(_message(func, args))


def _unscale(grads: List[Any], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale-and-check on `p.grad`s, done by their optimizer on its shards."""
    opts = {id(o): o for g in grads if isinstance(g, LocalGrad) and (o := g._nd_opt()) is not None}
    if len(opts) != 1 or not all(isinstance(g, LocalGrad) for g in grads):
        raise ShardedGradError(
            "GradScaler unscales grads of which some are ZeRO-2 local grads and some are not (or "
            "of several sharded optimizers) in one call: give each nccl_ddp "
            "ZeroRedundancyOptimizer(zero_stage=2) its own parameters, and replace no p.grad"
        )
    (opt,) = opts.values()
    opt._amp_unscale_shards(inv_scale, found_inf)


def _message(func: Any, args: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    rank = next((g._nd_opt().group.rank for g in _tensors(args) if g._nd_opt() is not None), None)
    where = "" if rank is None else f"rank {rank}: "
    return (
        f"{where}{name} on a p.grad under ZeRO-2 (zero_stage=2): p.grad holds this rank's local "
        "gradient, the averaged one exists only as each rank's shard, so the result would "
        "silently differ from torch's. Clip with opt.clip_grad_norm_(max_norm) (it returns the "
        "global norm; Lightning's NcclDDPStrategy and nccl_ddp's Accelerator route their clipping "
        "there), unscale with GradScaler as usual, or use the default ZeRO-1, which keeps the "
        "full averaged gradient in p.grad"
    )


def _tensors(args: Any) -> List[LocalGrad]:
    out: List[LocalGrad] = []
    for a in args:
        if isinstance(a, LocalGrad):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


class GradGuard:
    """After every backward, each of `params`' non-None `.grad`s becomes a `LocalGrad`: a
    post-accumulate-grad hook queues one autograd-engine callback per backward, which runs after
    the DDP wrapper's (its hooks were registered first, so it queued first)."""

    def __init__(self, opt: Any, params: List[Any]) -> None:
        self._opt = weakref.ref(opt)
        self._params = list(params)
        self._queued = False
        self._handles: Optional[list] = [
            p.register_post_accumulate_grad_hook(self._grad_hook) for p in params
        ]

    def _grad_hook(self, p: Any) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._guard)

    def _guard(self) -> None:
        self._queued = False
        opt = self._opt()
        if opt is None:
            return
        for p in self._params:
            g = p.grad
            if g is not None and not isinstance(g, LocalGrad):
                p.grad = LocalGrad.wrap(g, opt)

    def remove(self) -> None:
        for h in self._handles or ():
            h.remove()
        self._handles = None
