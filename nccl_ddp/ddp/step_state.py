"""One step's bookkeeping for the reducer: which grads are ready, how many each bucket still
waits for, which bucket launches next, the comm stream's done events, and whether the step is
open, synchronised and on the fast path. Pure host state (no device, no group): the reducer
schedules, this object counts; a new step starts a fresh count (`start`)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterator, List, Sequence

from nccl_ddp.buckets.layout import BucketLayout
from nccl_ddp.errors import ReducerError


class StepState:
    """The per-step state of `Reducer`. `mark(i, b)` is the whole per-grad update, shared by
    mark_ready's fast path and its general path."""

    __slots__ = (
        "ready",
        "count",
        "pending",
        "next",
        "done",
        "expected",
        "open",
        "syncs",
        "fast",
        "backward_ended",
    )

    def __init__(self, n: int) -> None:
        self.ready = bytearray(n)  # 1: grad i is ready this step
        self.count = 0  # grads ready this step (ones in `ready`)
        self.pending: List[int] = []  # per bucket: grads not yet ready
        self.next = 0  # the bucket that launches next (buckets launch in order)
        self.done: List[Any] = []  # the comm stream's event after each launched bucket
        self.expected = n  # grads that close the step when all are ready
        self.open = False
        self.syncs = True  # this step reduces (False: a no_sync() step)
        self.fast = False  # mark_ready may take its fast path
        self.backward_ended = False  # this step's end of backward is on the timeline

    def start(self, layout: BucketLayout, excluded: Collection[int], syncs: bool) -> None:
        """Open a step over `layout`; the parameters in `excluded` never get a grad."""
        n = len(self.ready)
        self.ready = bytearray(n)
        self.pending = [len(b.params) for b in layout.buckets]
        self.next, self.done, self.count = 0, [], 0
        self.expected = n - len(excluded)
        self.open, self.syncs, self.fast, self.backward_ended = True, syncs, False, False

    def mark(self, i: int, b: int) -> bool:
        """Count grad i ready (in bucket b; -1: none, or a no_sync() step that launches
        nothing). True when the next bucket to launch is complete or every expected grad is in:
        then the reducer has work to do."""
        self.ready[i] = 1
        self.count += 1
        if b >= 0:
            pending = self.pending
            pending[b] -= 1
            if b == self.next and not pending[b]:
                return True
        return self.count == self.expected

    def launchable(self) -> Iterator[int]:
        """The buckets that may launch now, in order: each once all its grads are ready and
        every bucket before it has launched."""
        while self.next < len(self.pending) and self.pending[self.next] == 0:
            yield self.next
            self.next += 1

    def check_new(
        self, i: int, rank: int, steps: int, excluded: Collection[int], label: Callable[[int], str]
    ) -> None:
        """ReducerError when grad i may not be marked ready now (twice in a step, or excluded)."""
        if self.ready[i]:
            raise ReducerError(
                f"rank {rank}: Expected to mark a variable ready only once. Parameter "
                f"{label(i)} was marked ready twice in step {steps}. Causes: the grad hook "
                "ran twice (the parameter is used twice with a hook per use, or backward ran twice "
                "without a forward in between); mark each parameter once per backward."
            )
        if i in excluded and self.syncs:
            raise ReducerError(
                f"rank {rank}: parameter {label(i)} received a grad, but with "
                "static_graph=True it was unused in the first step and is no longer reduced; the "
                "graph is not static: use find_unused_parameters=True instead"
            )

    def reduce_missing(self, missing: Sequence[int], bucket_of: Sequence[int]) -> None:
        """find_unused: the `missing` grads are reduced as they are; their buckets stop waiting."""
        for i in missing:
            if bucket_of[i] >= 0:
                self.pending[bucket_of[i]] -= 1

    def missing(self, excluded: Collection[int]) -> List[int]:
        """The parameters (not excluded) whose grad is not ready."""
        if self.count == len(self.ready):
            return []
        return [i for i in range(len(self.ready)) if not self.ready[i] and i not in excluded]

    def missing_message(
        self,
        head: str,
        rank: int,
        excluded: Collection[int],
        label: Callable[[int], str],
        finds_unused: bool = False,
    ) -> str:
        """torch's message for grads that never came, naming them; `finds_unused`: the step had
        find_unused_parameters=True, so only finalize() was missing."""
        missing = self.missing(excluded)
        shown = ", ".join(label(i) for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        advice = (
            "find_unused_parameters=True is on, but nothing ended that step: call finalize() on "
            "the DistributedDataParallel wrapper after every backward, before the optimizer step "
            "(this framework's backward has no end-of-backward callback to do it), so the grads "
            "that never came are reduced as they are"
            if finds_unused
            else "You can enable unused parameter detection by passing find_unused_parameters=True "
            "to DistributedDataParallel (and calling finalize() after backward), or make sure every "
            "parameter gets a grad (mark_ready) in every step"
        )
        return (
            f"rank {rank}: {head}. This error indicates that your module has "
            "parameters that were not used in producing loss. Parameter indices which did not "
            f"receive grad for rank {rank}: {shown}{more}. {advice}."
        )
