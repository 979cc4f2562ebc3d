"""The completion of one host collective, returned at once by every `HostProcessGroup` call."""

from __future__ import annotations

from typing import Any, Optional

from nccl_ddp.comm.group import Work
from nccl_ddp.device import HostEvent
from nccl_ddp.errors import CommTimeout


class HostWork(Work):
    """Completion of one queued collective; `event` can be waited on by a `device.Stream`."""

    def __init__(self, what: str, result: Any, timeout: float) -> None:
        self.what = what
        self.event = HostEvent()
        self._result = result
        self._timeout = timeout

    def _finish(self, error: Optional[BaseException]) -> None:
        self.event._set(error)

    def wait(self, timeout: Optional[float] = None) -> bool:
        t = self._timeout if timeout is None else timeout
        if not self.event.reached(t):
            raise CommTimeout(
                f"{self.what} did not complete within {t:.1f}s; a peer may be stuck "
                f"or slow (raise the timeout, or check the other ranks' logs)"
            )
        if self.event.error is not None:
            raise self.event.error
        return True

    def is_completed(self) -> bool:
        return self.event.query()

    def result(self) -> Any:
        self.wait()
        return self._result
