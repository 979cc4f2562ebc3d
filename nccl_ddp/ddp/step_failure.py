"""`StepFailure`: after a collective failed mid-step, every later call of a reducer says so.

A failed collective (peer died, group shut down) leaves the grads partly reduced and the ranks out
of step, and the group is unusable. DDP's `Reducer` and `DistributedGradReducer` keep the first
such error here and raise `ReducerError` with it as `__cause__` on every later call, instead of a
misleading follow-up error or the same low-level error again and again. A step that failed on this
rank alone (a hook's bad result, an error inside jax.jit's callback) also poisons the group, so
the peers' collectives of that step and every later one raise naming it, instead of waiting for
their timeout or pairing with this rank's next step.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import CommHookError, NonFiniteGradError, ReducerError


class StepFailure:
    """The first error that broke a step of one reducer (`error`), and the checks built on it."""

    def __init__(self, rank: int, owner: str, group: Optional[ProcessGroup] = None) -> None:
        self.rank = rank
        self.owner = owner  # what the user re-creates: "DistributedDataParallel"
        self.group = group  # poisoned by the first failure
        self.error: Optional[BaseException] = None

    @contextlib.contextmanager
    def closes_step(self, close: Optional[Callable[[], None]] = None) -> Iterator[None]:
        """Around a step's communication: an error (not a `ReducerError`, which reports the
        caller's misuse as it is, nor a `NonFiniteGradError` of a step that completed; but a
        `CommHookError`, a hook's bad result, which broke the step) is remembered, `close()`
        abandons the step, and it propagates."""
        try:
            yield
        except CommHookError as e:
            self._fail(e, close)
            raise
        except (ReducerError, NonFiniteGradError):  # the step itself completed
            raise
        except Exception as e:
            self._fail(e, close)
            raise

    def _fail(self, e: BaseException, close: Optional[Callable[[], None]]) -> None:
        if close is not None:
            close()
        if self.error is None:
            self.error = e
            if self.group is not None and not self.group.failed:
                self.group.poison(
                    f"rank {self.rank}: a step of {self.owner} failed on this rank ({type(e).__name__}: {e})"
                )

    def check(self) -> None:
        """Raise `ReducerError` (from the first failure) if a previous step failed."""
        e = self.error
        if e is not None:
            raise ReducerError(
                f"rank {self.rank}: a previous step failed ({type(e).__name__}: {e}); its grads "
                "are partly reduced and the ranks are out of step (the process group is unusable "
                "after a communication failure). Restart the job (or destroy_process_group(), "
                f"then create a new process group and a new {self.owner})"
            ) from e
