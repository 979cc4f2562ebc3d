"""`StepFailure`: after a collective failed mid-step, every later call of a reducer says so.

A failed collective (peer died, group shut down) leaves the grads partly reduced and the ranks out
of step, and the group is unusable. DDP's `Reducer` and `DistributedGradReducer` keep the first
such error here and raise `ReducerError` with it as `__cause__` on every later call, instead of a
misleading follow-up error or the same low-level error again and again.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from nccl_ddp.errors import NonFiniteGradError, ReducerError


class StepFailure:
    """The first error that broke a step of one reducer (`error`), and the checks built on it."""

    def __init__(self, rank: int, owner: str) -> None:
        self.rank = rank
        self.owner = owner  # what the user re-creates: "DistributedDataParallel"
        self.error: Optional[BaseException] = None

    @contextlib.contextmanager
    def closes_step(self, close: Optional[Callable[[], None]] = None) -> Iterator[None]:
        """Around a step's communication: an error (not a `ReducerError`, which reports the
        caller's misuse as it is, nor a `NonFiniteGradError` of a step that completed) is
        remembered, `close()` abandons the step, and it propagates."""
        try:
            yield
        except (ReducerError, NonFiniteGradError):  # the step itself completed
            raise
        except Exception as e:
            if close is not None:
                close()
            if self.error is None:
                self.error = e
            raise

    def check(self) -> None:
        """Raise `ReducerError` (from the first failure) if a previous step failed."""
        e = self.error
        if e is not None:
            raise ReducerError(
                f"rank {self.rank}: a previous step failed ({type(e).__name__}: {e}); its grads "
                "are partly reduced and the process group is unusable after a communication "
                "failure. Restart the job (or destroy_process_group(), then create a new process "
                f"group and a new {self.owner})"
            ) from e
