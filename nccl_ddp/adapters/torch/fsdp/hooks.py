"""The module and autograd hooks that drive a `fully_shard` unit (FSDP2's contract): before the
module's forward its parameters are gathered (and the next unit's prefetched), after it they are
freed (`reshard_after_forward`); a hook on every output that needs a grad gathers them again
before the module's backward, and an autograd function on each forward call's inputs runs the
unit's post-backward (the reduce-scatter of what backward added since) once backward has gone
through that call. A forward during the unit's backward (activation checkpointing's
recomputation) only gathers and casts. The unit's mixed-precision casts of inputs and outputs
happen here too."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from nccl_ddp.adapters.torch.fsdp.unit import Phase, Unit
from nccl_ddp.adapters.torch.tensors import torch_stream_current

if TYPE_CHECKING:
    import torch

FORWARD_HOOKS = "_nccl_ddp_fsdp_forward_hooks"  # on a sharded module: its (pre, post) forward hooks


def install(modules: List[torch.nn.Module], unit: Unit, policy: Any) -> None:
    """Register the unit's forward hooks on its modules. `policy`: a MixedPrecisionPolicy or
    None. For several modules (`fully_shard([a, b])`, FSDP2's grouping, torch 2.13's rules): the
    first of them to run in a pass gathers (and registers the post-backward); each later one
    only makes sure the unit is gathered and casts its own inputs; the post-forward runs when
    the last of them has run (the others cast their outputs only), or at the root's
    post-forward for those a forward skipped (`force_complete`). A module of the group run
    apart after that (its pass incomplete, the unit not in a forward) starts a call of its
    own: gathered, and a post-backward registered on its inputs."""
    pre = _timed(unit, functools.partial(_pre_forward, unit, policy))
    post = _timed(unit, functools.partial(_post_forward, unit, policy))
    if len(modules) == 1:
        modules[0].register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        modules[0].register_forward_hook(post, prepend=False)
        setattr(modules[0], FORWARD_HOOKS, (pre, post))
        return
    join = _timed(unit, functools.partial(_join_forward, unit, policy))
    ids = {id(m) for m in modules}

    def grouped_pre(module: Any, args: tuple, kwargs: dict) -> Any:
        if not unit.to_run:  # the first of the group in this pass
            unit.to_run.update(ids)
        if unit.phase is Phase.FORWARD:  # another of the group began this call
            return join(module, args, kwargs)
        return pre(module, args, kwargs)

    def post_of(member: Any) -> Callable[..., Any]:
        def grouped_post(module: Any, args: tuple, output: Any) -> Any:
            if id(member) in unit.to_run:
                unit.to_run.discard(id(member))
                if not unit.to_run:
                    return post(module, args, output)
            return _cast_output(policy, output)

        return grouped_post

    unit.complete_forward = functools.partial(post, None, ())
    for m in modules:
        m.register_forward_pre_hook(grouped_pre, prepend=True, with_kwargs=True)
        member_post = post_of(m)
        m.register_forward_hook(member_post, prepend=False)
        setattr(m, FORWARD_HOOKS, (grouped_pre, member_post))


def run_as_forward(module: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`method(*args, **kwargs)` between `module`'s pre- and post-forward hooks, as if it were
    the module's forward (`register_fsdp_forward_method`: gathered before, resharded after,
    the output hooked for backward)."""
    pre, post = forward_hooks(module)
    args, kwargs = pre(module, args, kwargs)
    return post(module, args, method(*args, **kwargs))


def forward_hooks(module: Any) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """The (pre, post) forward hooks `install` registered on `module`."""
    hooks: Tuple[Callable[..., Any], Callable[..., Any]] = getattr(module, FORWARD_HOOKS)
    return hooks


def force_complete(root: Unit, output: Any) -> Any:
    """At the root's post-forward: the post-forward of every grouped unit whose forward ran
    only some of its modules (it reshards and hooks the root's output for the re-gather
    before backward), innermost first, as torch's `_force_complete_incomplete_states`."""
    for unit in reversed(root.schedule.units):
        if unit is not root and unit.to_run and unit.complete_forward is not None:
            unit.to_run.clear()
            output = unit.complete_forward(output)
    return output


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

    if unit.phase is Phase.PRE_BACKWARD:  # recomputed in backward: its post-backward is registered
        unit.wait()
        return _cast_inputs(policy, args, kwargs)
    unit.pre_forward()
    args, kwargs = _cast_inputs(policy, args, kwargs)
    if not torch.is_grad_enabled():
        return args, kwargs
    leaves, spec = tree_flatten((args, kwargs))
    needs = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if needs:
        out = _PostBackward.apply(unit, *[leaves[i] for i in needs])
        for i, t in zip(needs, out if isinstance(out, tuple) else (out,)):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs


def _join_forward(unit: Unit, policy: Any, module: Any, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """A later module of a grouped unit already in its pass: the unit gathered (again, if a
    partial pass left it sharded), the module's own inputs cast."""
    unit.wait()
    return _cast_inputs(policy, args, kwargs)


def _cast_inputs(policy: Any, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    param_dtype = getattr(policy, "param_dtype", None)
    if param_dtype is not None and getattr(policy, "cast_forward_inputs", True):
        cast: Tuple[tuple, dict] = _cast((args, kwargs), param_dtype)
        return cast
    return args, kwargs


def _cast_output(policy: Any, output: Any) -> Any:
    output_dtype = getattr(policy, "output_dtype", None)
    return output if output_dtype is None else _cast(output, output_dtype)


def _post_forward(unit: Unit, policy: Any, module: Any, args: tuple, output: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_flatten

    if unit.phase is Phase.PRE_BACKWARD:  # recomputed in backward: the unit stays gathered
        return _cast_output(policy, output)
    unit.post_forward()
    output = _cast_output(policy, output)
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(_pre_backward, unit))
    if unit is unit.schedule.root:
        output = force_complete(unit, output)
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
        """Identity on one forward call's inputs; its backward runs once every grad of those
        inputs is computed, i.e. after that call's backward: a post-backward of the unit."""

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
