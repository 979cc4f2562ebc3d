"""torch's communication hooks on our torch DDP wrapper.

torch's `default_hooks.allreduce_hook` / `fp16_compress_hook` / `bf16_compress_hook` with
`state=None` become ours (`nccl_ddp.hooks`, fused into the bucket kernels; the same results).
Any other hook that is not ours (torch's `powerSGD_hook`, a user's hook written for torch) gets a
`TorchGradBucket`, which behaves as torch's `dist.GradBucket` with torch tensors that are
zero-copy DLPack views of our bucket, and returns a `torch.futures.Future` that we wait for. Such
hooks run torch.distributed collectives on `state`'s torch group or torch's default (WORLD) group:
torch.distributed must be initialised (gloo on the CPU) on the same ranks.

Sparse grads (Embedding(sparse=True), adapters/torch/sparse.py) meet a hook as torch's reducer
hands them over: each in a bucket of its own (`SparseGradBucket`, after the dense buckets), whose
`buffer()` is the sparse grad, not yet averaged; the future's sparse tensor becomes `p.grad`
(`route_sparse`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, ContextManager, List, Optional, Tuple

from nccl_ddp.adapters.torch.sparse import SparseParams, as_sparse
from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp import comm_hooks
from nccl_ddp.errors import CommHookError, CommTimeout, ConfigError, ConfigTypeError

if TYPE_CHECKING:
    import torch


def ours_for(hook: object, state: object) -> Optional[Callable]:
    """Our fused hook for one of torch's default hooks with `state=None` (None otherwise)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    if state is not None:
        return None
    for theirs, ours in (
        (d.allreduce_hook, comm_hooks.allreduce_hook),
        (d.fp16_compress_hook, comm_hooks.fp16_compress_hook),
        (d.bf16_compress_hook, comm_hooks.bf16_compress_hook),
    ):
        if hook is theirs:  # by identity: a hook object need not be hashable
            return ours
    return None


def check_like_torch(hook: object, rank: int) -> None:
    """torch DDP's checks of a hook at registration, with its error types and messages (code and
    tests written for torch match them): callable (TypeError), and where annotated, a bucket of
    `dist.GradBucket` and a result of `torch.futures.Future[torch.Tensor]` (ValueError). String
    annotations (`from __future__ import annotations`) are evaluated; where that fails they are
    not checked (torch compares the strings and refuses them)."""
    import inspect

    import torch
    import torch.distributed as dist

    if not callable(hook):
        raise ConfigTypeError(f"rank {rank}: Communication hook must be callable.")
    if is_ours(hook):
        return  # nccl_ddp.hooks take our buckets (annotated so)
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, ValueError):
        return  # no signature (a builtin), or annotations that do not evaluate: not checked
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ConfigError(f"rank {rank}: Communication hook: bucket annotation should be dist.GradBucket.")
    if sig.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ConfigError(
            f"rank {rank}: Communication hook: return annotation should be "
            "torch.futures.Future[torch.Tensor]."
        )


def builtin_hook(comm_hook_type: object, rank: int) -> Callable:
    """Our fused hook for torch's `dist.BuiltinCommHookType` (ALLREDUCE, FP16_COMPRESS)."""
    import torch.distributed as dist

    if not isinstance(comm_hook_type, dist.BuiltinCommHookType):
        raise ConfigTypeError(
            f"rank {rank}: _register_builtin_comm_hook takes a dist.BuiltinCommHookType, got "
            f"{type(comm_hook_type).__name__} {comm_hook_type!r}"
        )
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return comm_hooks.fp16_compress_hook
    return comm_hooks.allreduce_hook


def is_ours(hook: object) -> bool:
    """A hook of nccl_ddp.hooks (it takes native buckets)."""
    return (getattr(hook, "__module__", "") or "").startswith("nccl_ddp.")


def check_torch_world(hook: object, state: object, group: ProcessGroup) -> None:
    """torch's own hooks call torch.distributed collectives (on `state.process_group` or WORLD):
    refuse them at registration when torch.distributed cannot run them on our ranks."""
    import torch.distributed as dist

    if not (getattr(hook, "__module__", "") or "").startswith("torch."):
        return  # a user's hook: its collectives are its own business
    name = getattr(hook, "__qualname__", repr(hook))
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"rank {group.rank}: register_comm_hook({name}) : torch's hook all-reduces with "
            "torch.distributed, which is not initialised. Initialise it on the same ranks first "
            "(torch.distributed.init_process_group('gloo') on the CPU, as Lightning and Accelerate "
            "do), or use nccl_ddp.hooks (allreduce, fp16_compress, bf16_compress, powersgd)"
        )
    torch_group = getattr(state, "process_group", None) if state is not None else None
    if isinstance(state, dist.ProcessGroup):
        torch_group = state
    size, rank = dist.get_world_size(torch_group), dist.get_rank(torch_group)
    if (size, rank) != (group.size, group.rank):
        raise ConfigError(
            f"rank {group.rank}: register_comm_hook({name}): torch's hook reduces over a "
            f"torch.distributed group of {size} ranks where this is rank {rank}, but this DDP's "
            f"group has {group.size} ranks where it is rank {group.rank}: the hook must reduce "
            "over the same ranks (pass a matching torch group in its state)"
        )


class TorchGradBucket:
    """torch's `dist.GradBucket` over one of our buckets: `buffer()` is a torch tensor viewing
    the bucket's grads (its alignment padding left out), `gradients()` views of it shaped like
    the parameters, `parameters()` the torch parameters."""

    def __init__(
        self, bucket: comm_hooks.GradBucket, params: List[torch.nn.Parameter], is_last: bool
    ) -> None:
        self._bucket, self._params, self._is_last = bucket, params, is_last
        self._numel = bucket.numel()
        self._buffer = from_native(bucket.buffer()[: self._numel])

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the bucket's contents with `buffer`'s (copied into our bucket memory, which
        the grads view)."""
        self._buffer.copy_(buffer.reshape(-1))

    def gradients(self) -> List[torch.Tensor]:
        return [
            self._buffer[o : o + n].view(s)
            for o, n, s in zip(self._bucket.offsets(), self._bucket.numels(), self._bucket.shapes())
        ]

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self._params)


class TorchHook:
    """A hook written for torch, run by our reducer: gets a `TorchGradBucket`, returns a torch
    future whose tensor becomes the bucket's reduced value. `buckets_after`: the sparse grads'
    buckets that follow the dense ones (`route_sparse`): the last dense one is then not last."""

    def __init__(self, hook: Callable, torch_params: dict, on_cuda: bool) -> None:
        self.hook, self._params, self.on_cuda = hook, torch_params, on_cuda
        self.__name__ = getattr(hook, "__name__", type(hook).__name__)
        self.buckets_after = 0

    def __call__(self, state: object, bucket: comm_hooks.GradBucket) -> comm_hooks.Future:
        params = [self._params[id(p)] for p in bucket.parameters()]
        tb = TorchGradBucket(bucket, params, bucket.is_last() and not self.buckets_after)
        fut = self.start(state, tb, bucket.process_group.rank, f"bucket {bucket.index()}")
        return comm_hooks.Future(lambda: self._result(fut, tb, bucket))

    def start(self, state: object, bucket: object, rank: int, what: str) -> torch.futures.Future:
        """The hook's future for `bucket` (a torch GradBucket), checked to be one."""
        with _torch_on_current_stream(self.on_cuda):
            fut = self.hook(state, bucket)
        if not (hasattr(fut, "wait") and hasattr(fut, "value")):
            raise CommHookError(
                f"rank {rank}: comm hook {self.__name__}: callback must return a "
                f"torch.futures.Future object, but got {type(fut).__name__} for {what}; return "
                "a Future of the reduced bucket tensor"
            )
        return fut

    def value_of(self, fut: torch.futures.Future, group: ProcessGroup, what: str) -> object:
        """What `fut` (from `start`) holds once done, within the group's timeout; a
        collective's list of one tensor unwrapped."""
        where = f"rank {group.rank}: comm hook {self.__name__}"
        with _torch_on_current_stream(self.on_cuda):
            value = _wait(fut, group.timeout, f"{where}: the future it returned for {what}")
        if isinstance(value, (list, tuple)) and len(value) == 1:
            return value[0]
        return value

    def _result(
        self, fut: torch.futures.Future, tb: TorchGradBucket, bucket: comm_hooks.GradBucket
    ) -> NativeArray:
        import torch

        group = bucket.process_group
        where = f"rank {group.rank}: comm hook {self.__name__}"
        value = self.value_of(fut, group, f"bucket {bucket.index()}")
        held = f"{tb.buffer().numel()} {tb.buffer().dtype} elements"
        if not isinstance(value, torch.Tensor):
            raise CommHookError(
                f"{where} returned a future of {comm_hooks.describe(value)} for bucket "
                f"{bucket.index()}, which holds {held}; its value must be the reduced bucket "
                "tensor (or a list of that one tensor, as a collective's future holds)"
            )
        buf = bucket.buffer()
        if value.data_ptr() != tb.buffer().data_ptr():
            if value.numel() != tb.buffer().numel() or value.dtype != tb.buffer().dtype:
                raise CommHookError(
                    f"{where} returned a {tuple(value.shape)} {value.dtype} "
                    f"tensor for bucket {bucket.index()}, which holds {held}; return the reduced "
                    "bucket buffer"
                )
            buf[: tb.buffer().numel()] = to_native(value.reshape(-1))
        return buf


# ---------------------------------------------------------------------------------------------
# sparse grads


def route_sparse(
    sparse: SparseParams,
    hook: Callable,
    what: str,
    state: object,
    dense_buckets: Callable[[], int],
    rank: int,
) -> Optional[SparseHook]:
    """How the registered `hook` (what the reducer runs; `what` names it as registered) meets
    the grads reduced as sparse, if the model has any: the `SparseParams.through_hook` to set
    once it is registered, or None. A hook written for torch (`TorchHook`) gets each in a bucket
    of its own after the `dense_buckets()` dense ones, as torch's reducer hands it one. Our
    all-reduce (torch's `allreduce_hook` with state None, the ALLREDUCE built-in) leaves them to
    the sparse all-reduce, which computes what torch's `allreduce_hook` does with them (each
    rank's grad divided by the group size, then summed). Our compressing hooks refuse them
    (torch's `fp16_compress_hook` fails on them too: no sparse float16 sum)."""
    if not sparse or hook is comm_hooks.allreduce_hook:
        return None
    if isinstance(hook, TorchHook):
        hook.buckets_after = len(sparse.params)
        return SparseHook(hook, state, dense_buckets)
    sparse.refuse(
        rank,
        what,
        "; torch's allreduce_hook, or a hook of your own written for torch, reduces them (each "
        "in a bucket of its own, as torch's DDP hands them over)",
    )
    return None


class SparseGradBucket:
    """torch's `dist.GradBucket` of one sparse grad, as torch's reducer builds it: `buffer()` is
    the parameter's sparse grad itself (this rank's, not averaged), `parameters()` the one
    parameter, `gradients()` empty (torch's sparse bucket has no dense views)."""

    def __init__(self, index: int, is_last: bool, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        self._index, self._is_last, self._param, self._buffer = index, is_last, param, grad

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> List[torch.Tensor]:
        return []

    def parameters(self) -> List[torch.nn.Parameter]:
        return [self._param]


class SparseHook:
    """The end of a synchronised backward with a torch hook registered: each sparse grad goes
    through the hook (all the hooks started, then each result waited for and installed as the
    parameter's `.grad`). A rank whose grad is None hands the hook an empty one (the hook's
    collectives need every rank), so `.grad` is then the hook's result."""

    def __init__(self, hook: TorchHook, state: object, dense_buckets: Callable[[], int]) -> None:
        self.hook, self.state, self.dense_buckets = hook, state, dense_buckets

    def __call__(self, sparse: SparseParams, group: ProcessGroup) -> None:
        first = self.dense_buckets()
        last = first + len(sparse.params) - 1
        started: List[Tuple[str, torch.nn.Parameter, torch.futures.Future]] = []
        for k, (name, p) in enumerate(zip(sparse.names, sparse.params)):
            p.grad = _local_grad(p)
            bucket = SparseGradBucket(first + k, first + k == last, p, p.grad)
            started.append(
                (name, p, self.hook.start(self.state, bucket, group.rank, _which(first + k, name)))
            )
        for k, (name, p, fut) in enumerate(started):
            what = _which(first + k, name)
            p.grad = _sparse_result(
                self.hook.value_of(fut, group, what),
                p,
                f"rank {group.rank}: comm hook {self.hook.__name__}",
                what,
            )


def _which(index: int, name: str) -> str:
    return f"bucket {index} (the sparse grad of parameter {name!r})"


def _local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's sparse grad of `p`; an empty one where `.grad` is None."""
    import torch

    if p.grad is not None:
        return as_sparse(p.grad)
    indices = torch.empty((1, 0), dtype=torch.int64, device=p.device)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, dtype=p.dtype, device=p.device)


def _sparse_result(value: object, p: torch.nn.Parameter, where: str, what: str) -> torch.Tensor:
    """`value` (what the hook's future held for `p`'s sparse bucket), checked to be a grad of
    `p`: a sparse COO tensor of its shape, dtype and device."""
    import torch

    if (
        isinstance(value, torch.Tensor)
        and value.layout == torch.sparse_coo
        and value.shape == p.shape
        and value.dtype == p.dtype
        and value.device == p.device
    ):
        return value
    got = comm_hooks.describe(value)
    if isinstance(value, torch.Tensor):
        got = f"a {value.layout} tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
    raise CommHookError(
        f"{where} returned a future of {got} for {what}; its value must be the reduced grad: a "
        f"torch.sparse_coo tensor of shape {tuple(p.shape)}, {p.dtype} on {p.device} (or a list "
        "of that one tensor, as a collective's future holds)"
    )


def _wait(fut: torch.futures.Future, timeout: float, what: str) -> object:
    """`fut.wait()`, bounded by `timeout` (the group's): torch's `Future.wait` takes none, and a
    hook's future that is never completed would hang the step for ever."""
    if not fut.done():
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise CommTimeout(
                f"{what} did not complete within {timeout:g}s (the process group's timeout): "
                "the collective it waits on may be stuck on a peer, or the hook never completes "
                "its future (set_result / set_exception)"
            )
    return fut.wait()


def _torch_on_current_stream(on_cuda: bool) -> ContextManager[object]:
    """On CUDA, torch's current stream becomes CuPy's current one (the reducer's comm stream),
    so the hook's torch work is ordered with the bucket's."""
    import contextlib

    if not on_cuda:
        return contextlib.nullcontext()
    import cupy
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr))
