"""The failure half of the NCCL group (`GroupWatchdog`, a base of `NcclProcessGroup`): the watchdog
thread that polls `ncclCommGetAsyncError` and the done-events of the ops in flight, `poison` and
the peers' poison notices in the store, and the abort of the communicator.

Enqueue and abort are serialized (as torch's ProcessGroupNCCL does with its communicator mutex):
CuPy releases the GIL inside every NCCL call and zeroes its handle only after `ncclCommAbort`
returns, so an abort from the watchdog thread while the training thread is inside
`ncclAllReduce` would free the communicator under that call. Every use of the communicator holds
`_comm_lock`; the watchdog waits for it up to ABORT_LOCK_WAIT seconds, and if an NCCL call is
still in progress (blocked connecting to a dead peer, say) it leaves the abort to that call's
thread, which performs it, still holding the lock, as soon as the call returns.

nccl/backend.py builds the group and enqueues the collectives; the attributes
declared below are set by `NcclProcessGroup.__init__`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Iterator, Optional

from nccl_ddp.comm.nccl.runtime import ADVICE
from nccl_ddp.errors import CommError, CommTimeout

log = logging.getLogger(__name__)

ABORT_LOCK_WAIT = 1.0  # seconds the watchdog waits for an NCCL call in progress before handing
# the abort to that call's thread
POISON_PROBE_AFTER = 1.0  # seconds an op runs before the watchdog asks the store (then once per
# such interval) whether a peer poisoned the group: a healthy job's ops finish first and pay nothing


class GroupWatchdog:
    """Failure detection, poisoning and abort for `NcclProcessGroup` (module doc)."""

    name: str
    timeout: float
    device_id: int
    _comm: Any
    _rt: Any
    _store: Any
    _poll: float
    _pending: list
    _lock: threading.Lock
    _comm_lock: threading.Lock
    _abort_due: bool
    _failure: Optional[tuple]
    _closed: bool
    _released: bool
    _stop: threading.Event
    _next_probe: float

    @contextlib.contextmanager
    def _using_comm(self, what: str) -> Iterator[None]:
        """Hold the communicator for one NCCL call; perform an abort the watchdog left to us."""
        if not self._comm_lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"{what}: an earlier NCCL call on group {self.name!r} has not "
                f"returned within {self.timeout:g}s (another thread is blocked "
                f"inside NCCL). {ADVICE}"
            )
        try:
            self._raise_if_failed(what)
            if self._released:
                raise CommError(f"{what}: the communicator of group {self.name!r} was released")
            yield
        finally:
            try:
                if self._abort_due:
                    self._release_locked(abort=True)
            finally:
                self._comm_lock.release()

    def _raise_if_failed(self, current: str) -> None:
        if self._failure is not None:
            cls, msg, cause = self._failure
            raise cls(f"{msg} (raised at {current})") from cause
        if self._closed:
            raise CommError(f"{current}: group {self.name!r} was shut down; create a new group")

    def _watch(self) -> None:
        try:
            self._rt.bind_thread()
        except self._rt.errors as e:
            log.warning("NCCL watchdog of group %r could not select GPU %d: %s", self.name, self.device_id, e)
        while not self._stop.wait(self._poll):
            failure = self._poll_once(time.monotonic())
            if failure is not None:
                self._fail(*failure)
                return

    def _poll_once(self, now: float) -> Optional[tuple]:
        """(class, message, cause) of the first problem found, else None; drops finished ops."""
        with self._lock:
            pending = list(self._pending)
        try:
            self._comm.check_async_error()
        except self._rt.errors as e:
            during = pending[0].what if pending else f"no op in flight on group {self.name!r}"
            return (
                CommError,
                f"NCCL reported an asynchronous error during {during}: {e}; the "
                f"communicator was aborted. {ADVICE}",
                e,
            )
        finished = set()
        for w in pending:
            try:
                if self._rt.query(w.event):
                    finished.add(id(w))
                    continue
            except self._rt.errors as e:
                return CommError, f"NCCL {w.what} failed on the GPU: {e}. {ADVICE}", e
            if now - w.started > POISON_PROBE_AFTER:
                reason = self._peer_poison(now)
                if reason is not None:
                    return (
                        CommError,
                        f"NCCL {w.what} cannot complete: a peer gave up on group {self.name!r}: "
                        f"{reason}; the communicator was aborted. {ADVICE}",
                        None,
                    )
            if now - w.started > self.timeout:
                return (
                    CommTimeout,
                    f"NCCL {w.what} did not complete within {self.timeout:g}s; "
                    f"the communicator was aborted. A peer rank probably died or "
                    f"hangs, or the ranks called collectives in different orders. "
                    f"{ADVICE}",
                    None,
                )
        if finished:
            with self._lock:
                self._pending = [w for w in self._pending if id(w) not in finished]
        return None

    def poison(self, reason: str) -> None:
        """The group fails here with `reason` and the communicator is aborted; this rank's later
        collectives raise naming it. The reason goes to the store: a peer whose collective with
        this rank has not completed after `POISON_PROBE_AFTER` finds it there (its watchdog
        looks only then) and fails naming it, instead of at the group's timeout."""
        if self._failure is None:
            self._fail(CommError, reason, None)
        if self._store is not None:
            try:
                self._store.set(self._poison_key, reason.encode())
            except Exception as e:  # noqa: BLE001 - the peers then fail at their timeout
                log.warning("group %r: could not tell the peers through the store (%s)", self.name, e)

    @property
    def _poison_key(self) -> str:
        return f"poisoned/{self.name}"

    def _peer_poison(self, now: float) -> Optional[str]:
        """A peer's poison notice, looked up at most once per `POISON_PROBE_AFTER`."""
        if self._store is None or now < self._next_probe:
            return None
        self._next_probe = now + POISON_PROBE_AFTER
        try:
            return bytes(self._store.get(self._poison_key, timeout=0.01)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - no notice (StoreTimeout), or the store is gone
            return None

    def _fail(self, cls: type, msg: str, cause: Optional[BaseException]) -> None:
        self._failure = (cls, msg, cause)
        log.error("%s", msg)
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        """Abort or destroy the communicator once no NCCL call is using it (module doc)."""
        if abort:
            self._abort_due = True  # before the lock: a call holding it sees this on its way out
        if not self._comm_lock.acquire(timeout=ABORT_LOCK_WAIT if abort else self.timeout):
            self._abort_due = True
            log.warning(
                "NCCL %s of group %r deferred: an NCCL call of another thread is in "
                "progress; that thread aborts the communicator when the call returns",
                "abort" if abort else "destroy",
                self.name,
            )
            return
        try:
            self._release_locked(abort)
        finally:
            self._comm_lock.release()

    def _release_locked(self, abort: bool) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._comm.abort() if abort else self._comm.destroy()
        except self._rt.errors as e:
            log.warning("NCCL %s of group %r failed: %s", "abort" if abort else "destroy", self.name, e)
