"""Communication hooks, with torch's `register_comm_hook` contract: how a bucket's grads are reduced.

A hook is `hook(state, bucket) -> future`. `bucket` (`GradBucket`) holds the bucket's flat buffer
of this rank's grads, not yet averaged (the hook averages, as torch's do); the hook returns a
`Future` (or a `Work`) whose value is the reduced buffer. The reducer copies that value into the
bucket if it is another array, then on into the grads. Hooks run in comm-stream order (the host
comm thread; on CUDA with the comm stream current), so collectives they issue through
`all_reduce_fut` are ordered with the bucket's other work.

The built-ins (`nccl_ddp.hooks`) compute what torch's `default_hooks` compute. The reducer's
bucket submission (`ddp/bucket_submit.py`) also recognises them (`builtin_compression`) and runs them in
its fused kernels: `allreduce_hook` is its default path; `fp16_compress_hook` /
`bf16_compress_hook` pack a float32 bucket straight into the compression dtype with the 1/world scale
(one launch), all-reduce that, and unpack it widened back; where the group rounds as it sums
(`fuses_compression`: fp16 on the host's shared memory) that is one all-reduce of the float32 bucket.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.comm.group import ProcessGroup, ReduceOp, Work
from nccl_ddp.errors import ConfigTypeError

CommHook = Callable[[Any, "GradBucket"], Any]


class GradBucket:
    """What a hook gets (torch's `dist.GradBucket`): the flat buffer of one bucket's grads, the
    parameters it holds and its index. Arrays are native (NumPy on "host", CuPy on "nccl")."""

    def __init__(
        self,
        index: int,
        buffer: Any,
        offsets: List[int],
        shapes: List[tuple],
        parameters: List[Any],
        is_last: bool,
        group: ProcessGroup,
    ) -> None:
        self._index, self._buffer, self._offsets = index, buffer, offsets
        self._shapes, self._parameters, self._is_last = shapes, parameters, is_last
        self.process_group = group  # the DDP's group: what `state=None` means

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        """The flat buffer (padded to the bucket's alignment; padding is zero)."""
        return self._buffer

    def set_buffer(self, buffer: Any) -> None:
        self._buffer = buffer

    def gradients(self) -> List[Any]:
        """Each parameter's grad: a view of the buffer, shaped like the parameter."""
        return [
            self._buffer[o : o + int(np.prod(s, dtype=np.int64))].reshape(s)
            for o, s in zip(self._offsets, self._shapes)
        ]

    def parameters(self) -> List[Any]:
        """The bucket's parameters (native arrays), in bucket order."""
        return list(self._parameters)

    def offsets(self) -> List[int]:
        """Where each parameter's grad starts in the buffer (elements)."""
        return list(self._offsets)

    def shapes(self) -> List[tuple]:
        return list(self._shapes)

    def numels(self) -> List[int]:
        return [int(np.prod(s, dtype=np.int64)) for s in self._shapes]

    def numel(self) -> int:
        """The buffer's elements up to the end of the last grad (without the end padding)."""
        return max((o + n for o, n in zip(self._offsets, self.numels())), default=0)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the step."""
        return self._is_last


class Future:
    """A value that may still be in flight (the part of `torch.futures.Future` hooks use):
    `wait()` returns it; `then(fn)` chains `fn(self)`."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        self._wait: Optional[Callable[[], Any]] = wait
        self._value: Any = None

    @classmethod
    def completed(cls, value: Any) -> Future:
        f = cls(lambda: value)
        f.wait()
        return f

    def wait(self) -> Any:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._value = wait()
        return self._value

    def value(self) -> Any:
        return self.wait()

    def done(self) -> bool:
        return self._wait is None

    def then(self, fn: Callable[[Future], Any]) -> Future:
        return Future(lambda: fn(self._waited()))

    def _waited(self) -> Future:
        self.wait()
        return self


def resolve(result: Any, hook: Any) -> Any:
    """The reduced buffer a hook returned (a `Future`, a `Work`, or anything with `wait()` and
    `value()` like torch's futures)."""
    if isinstance(result, Future):
        return result.wait()
    if isinstance(result, Work):
        return result.result()
    if hasattr(result, "wait") and hasattr(result, "value"):
        result.wait()
        return result.value()
    name = getattr(hook, "__name__", type(hook).__name__)
    raise ConfigTypeError(
        f"comm hook {name} returned {type(result).__name__}; a hook must return "
        "a nccl_ddp.hooks.Future (e.g. from all_reduce_fut) or a Work whose value "
        "is the reduced bucket buffer"
    )


def describe(value: Any) -> str:
    """What a hook's future held, for messages: "a list of 2 Tensor", "a str"."""
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(kinds) or 'items'}"
    return f"a {type(value).__name__}"


def current_stream(group: ProcessGroup) -> Any:
    """The stream collectives of a hook are ordered on: the caller's (the comm stream inside a
    reducer; on the host the calling thread, which runs a collective synchronously)."""
    from nccl_ddp.comm.api import device_of

    return device_of(group).current_stream()


def all_reduce_fut(group: ProcessGroup, buf: Any, op: ReduceOp = ReduceOp.SUM) -> Future:
    """All-reduce `buf` in place on `group`, in the current stream's order; the future's value
    is `buf`."""
    work = group.all_reduce(buf, op, stream=current_stream(group), tag="a comm hook's buffer")
    return Future(lambda: (work.wait(group.timeout), buf)[1])


# ---------------------------------------------------------------------------------------------
# built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks)


def allreduce_hook(state: Optional[ProcessGroup], bucket: GradBucket) -> Future:
    """Average the bucket over `state` (None: the DDP's group): divide, then all-reduce SUM."""
    group = state or bucket.process_group
    buf = bucket.buffer()
    kernels.scale_(buf, 1.0 / group.size)
    return all_reduce_fut(group, buf)


def _compress_hook(wire: str) -> CommHook:
    def hook(state: Optional[ProcessGroup], bucket: GradBucket) -> Future:
        group = state or bucket.process_group
        buf = bucket.buffer()
        # torch's order: cast to the compression dtype, then divide in it
        compressed = buf.astype(compression_dtype(wire))
        kernels.scale_(compressed, 1.0 / group.size)
        fut = all_reduce_fut(group, compressed)

        def decompress(f: Future) -> Any:
            buf[...] = f.value().astype(buf.dtype)
            return buf

        return fut.then(decompress)

    hook.__name__ = f"{'fp16' if wire == 'float16' else 'bf16'}_compress_hook"
    hook.__doc__ = (
        f"Average the bucket in {wire}: half the bytes on the wire (torch's "
        f"{hook.__name__}); the reducer fuses it into its pack/unpack kernels."
    )
    return hook


fp16_compress_hook = _compress_hook("float16")
bf16_compress_hook = _compress_hook("bfloat16")

_FUSED = {id(allreduce_hook): None, id(fp16_compress_hook): "float16", id(bf16_compress_hook): "bfloat16"}


def is_builtin(hook: Any) -> bool:
    return id(hook) in _FUSED


def builtin_compression(hook: Any) -> Optional[str]:
    """The dtype name a built-in compression hook sends its bucket in (None for allreduce and
    user hooks)."""
    return _FUSED.get(id(hook))


def compression_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a compression's dtype name ("bfloat16" is ml_dtypes')."""
    if name == "bfloat16":
        from nccl_ddp.arrays.dlpack import bfloat16_dtype

        return bfloat16_dtype()
    return np.dtype(name)


def check_hook(hook: Any) -> None:
    if not callable(hook):
        raise ConfigTypeError(
            f"hook must be callable as hook(state, bucket) -> Future, got {type(hook).__name__}"
        )
