"""Why a worker failed, as the launcher reads it (like torchrun's error files): the failing worker
writes a `FailureRecord` to $NCCL_DDP_ERROR_FILE (an uncaught exception, through the hook
`init_process_group` installs), the supervisor reads it back to name the root cause, and the
test harness (tests/support/mp.py) sends the same record from each failed rank.

It sits in the lowest layer because the writer runs inside the worker (comm/api.py installs it);
the launcher above reads it and orders the failures (launch/supervisor.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Mapping, Optional

ERROR_FILE_VAR = "NCCL_DDP_ERROR_FILE"  # nccl-ddp-run sets it: where this worker's record goes
MESSAGE_CAP = 4000  # characters of the message kept in a record
_BLAME = re.compile(r"peer rank (\d+)")
_hook_installed = False


def blamed_rank(exc: BaseException) -> Optional[int]:
    """The peer an error blames ("peer rank 1 closed the connection"), along its causes."""
    seen = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        m = _BLAME.search(str(cur))
        if m:
            return int(m.group(1))
        cur = cur.__cause__ or cur.__context__
    return None


def _int_or_none(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class FailureRecord:
    """One worker's failure: the exception's type and message, the rank that failed (None when
    unknown), when (time.time(); None: unknown, the launcher uses the exit time), the peer rank
    the error blames (None: none, so this rank failed for a reason of its own), its pid."""

    type: str
    message: str
    rank: Optional[int] = None
    time: Optional[float] = None
    blames: Optional[int] = None
    pid: Optional[int] = None

    @classmethod
    def of(cls, exc: BaseException, rank: Optional[int]) -> FailureRecord:
        """The record of `exc` raised on `rank`, now, in this process."""
        return cls(
            type(exc).__name__, str(exc)[:MESSAGE_CAP], rank, time.time(), blamed_rank(exc), os.getpid()
        )

    @classmethod
    def from_json(cls, data: object) -> Optional[FailureRecord]:
        """A record from its JSON object (None when `data` is not one); wrong-typed fields read
        as unknown rather than failing the launcher's summary."""
        if not isinstance(data, dict):
            return None
        when = data.get("time")
        return cls(
            type=str(data.get("type") or "error"),
            message=str(data.get("message", "")),
            rank=_int_or_none(data.get("rank")),
            time=float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
            blames=_int_or_none(data.get("blames")),
            pid=_int_or_none(data.get("pid")),
        )

    @classmethod
    def read(cls, path: Optional[str]) -> Optional[FailureRecord]:
        """The record at `path`; None when there is none or it cannot be read."""
        return cls.from_json(_load(path))

    @classmethod
    def read_torch(cls, path: Optional[str]) -> Optional[FailureRecord]:
        """The error file torch's `record` decorator writes to TORCHELASTIC_ERROR_FILE
        ({"message": {"message": "Type: text", "extraInfo": {"timestamp"}}}) as our record."""
        data = _load(path)
        body = data.get("message") if isinstance(data, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("message"), str):
            return None
        kind, sep, text = body["message"].partition(": ")
        if not sep:
            kind, text = "error", body["message"]
        extra = body.get("extraInfo")
        try:
            when: Optional[float] = float(extra["timestamp"])  # type: ignore[index]
        except (TypeError, ValueError, KeyError):
            when = None
        return cls(kind, text, time=when, blames=blamed_rank(RuntimeError(text)))

    def write(self, path: str) -> None:
        """Write the record to `path` unless one is there (the first failure wins), atomically;
        never raises: a record is a courtesy to the launcher, never mask the real error."""
        if os.path.exists(path):
            return
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(self), f)
            os.replace(tmp, path)
        except OSError:
            pass


def _load(path: Optional[str]) -> object:
    """The JSON at `path`; None when there is none or it cannot be read."""
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def record_failure(exc: BaseException, environ: Optional[Mapping[str, str]] = None) -> None:
    """Write why this worker fails to $NCCL_DDP_ERROR_FILE (once: the first failure wins), so
    the launcher can name the root cause instead of whichever rank exited first."""
    environ = os.environ if environ is None else environ
    path = environ.get(ERROR_FILE_VAR)
    if not path:
        return
    raw = environ.get("RANK", "").strip()
    FailureRecord.of(exc, int(raw) if raw.isdigit() else None).write(path)


def install_failure_hook() -> None:
    """Record an uncaught exception (sys.excepthook) when the launcher asked for records."""
    global _hook_installed
    if _hook_installed or not os.environ.get(ERROR_FILE_VAR):
        return
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        record_failure(value)
        previous(tp, value, tb)

    sys.excepthook = hook
    _hook_installed = True
