"""The module and autograd hooks that drive a `fully_shard` unit (FSDP2's contract): before the
module's forward its parameters are gathered (and the next unit's prefetched), after it they are
freed (`reshard_after_forward`); a hook on every output that needs a grad gathers them again
before the module's backward, and an autograd function on its inputs runs the unit's
post-backward (the reduce-scatter) once backward has gone through the module. The unit's
mixed-precision casts of inputs and outputs happen here too."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set, Tuple

from nccl_ddp.adapters.torch.fsdp.unit import Unit
from nccl_ddp.adapters.torch.tensors import torch_stream_current

if TYPE_CHECKING:
    import torch


def install(modules: List[torch.nn.Module], unit: Unit, policy: Any) -> None:
    """Register the unit's forward hooks on its modules. `policy`: a MixedPrecisionPolicy or
    None. For several modules (`fully_shard([a, b])`, FSDP2's grouping) the pre-forward runs
    before the first of them to run and the post-forward after the last of them has run."""
    pre = _timed(unit, functools.partial(_pre_forward, unit, policy))
    post = _timed(unit, functools.partial(_post_forward, unit, policy))
    if len(modules) == 1:
        modules[0].register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        modules[0].register_forward_hook(post, prepend=False)
        return
    first, post_of = _grouped(modules, pre, post)
    for m in modules:
        m.register_forward_pre_hook(first, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_of(m), prepend=False)


def _grouped(
    modules: List[torch.nn.Module], pre: Callable[..., Any], post: Callable[..., Any]
) -> Tuple[Callable[..., Any], Callable[[Any], Callable[..., Any]]]:
    """`pre` only when none of `modules` is mid-forward (the first to run), `post` once each of
    them has run (the set still to run empties)."""
    to_run: Set[int] = set()

    def grouped_pre(*args: Any) -> Any:
        if not to_run:
            to_run.update(id(m) for m in modules)
            return pre(*args)
        return None

    def post_of(module: Any) -> Callable[..., Any]:
        def grouped_post(*args: Any) -> Any:
            to_run.discard(id(module))
            return post(*args) if not to_run else None

        return grouped_post

    return grouped_pre, post_of


def _timed(unit: Unit, hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, its time (less the unit's gather waits) added to `unit.times.hooks_s`, its CPU
    time to `hooks_cpu_s`; on CUDA with torch's current stream as CuPy's (the compute stream
    the unit's waits are queued on)."""

    def timed(*args: Any) -> Any:
        times = unit.times
        t0, c0, waited = time.perf_counter(), time.thread_time(), times.waited_s
        try:
            with torch_stream_current(unit.schedule.on_cuda):
                return hook(*args)
        finally:
            times.hooks_cpu_s += time.thread_time() - c0
            times.hooks_s += time.perf_counter() - t0 - (times.waited_s - waited)

    return timed


def _pre_forward(unit: Unit, policy: Any, module: Any, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    unit.pre_forward()
    param_dtype = getattr(policy, "param_dtype", None)
    if param_dtype is not None and getattr(policy, "cast_forward_inputs", True):
        args, kwargs = _cast((args, kwargs), param_dtype)
    if not torch.is_grad_enabled():
        return args, kwargs
    unit.backward_open = True
    leaves, spec = tree_flatten((args, kwargs))
    needs = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if needs:
        unit.forward_calls += 1
        out = _PostBackward.apply(unit, *[leaves[i] for i in needs])
        for i, t in zip(needs, out if isinstance(out, tuple) else (out,)):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs


def _post_forward(unit: Unit, policy: Any, module: Any, args: tuple, output: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_flatten

    unit.post_forward()
    output_dtype = getattr(policy, "output_dtype", None)
    if output_dtype is not None:
        output = _cast(output, output_dtype)
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(_pre_backward, unit))
    return output


def _pre_backward(unit: Unit, grad: Any) -> Optional[Any]:
    _timed(unit, unit.pre_backward)()
    return None


def _cast(tree: Any, dtype: Any) -> Any:
    """Floating-point tensors of `tree` cast to `dtype` (the others as they are)."""
    import torch
    from torch.utils._pytree import tree_map

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _post_backward_function() -> Any:
    import torch

    class PostBackward(torch.autograd.Function):
        """Identity on the unit's inputs; its backward runs once every grad of those inputs is
        computed, i.e. after the unit's own backward: the unit's post-backward."""

        @staticmethod
        def forward(ctx: Any, unit: Unit, *inputs: torch.Tensor) -> Any:
            ctx.unit = unit
            return inputs

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            _timed(ctx.unit, ctx.unit.post_backward_call)()
            return (None, *grads)

    return PostBackward


class _Lazy:
    """The autograd function, built on first use (torch is imported lazily)."""

    fn: Any = None

    @classmethod
    def apply(cls, *args: Any) -> Any:
        if cls.fn is None:
            cls.fn = _post_backward_function()
        return cls.fn.apply(*args)


_PostBackward = _Lazy
