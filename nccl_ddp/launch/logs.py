"""Where each worker's stdout and stderr go: the console (prefixed, maybe filtered) and torchrun's
log layout, `LOG_DIR/<run_id>_<random>/attempt_<N>/<local_rank>/{stdout,stderr}.log` beside the
`error.json` that torch's `record` decorator writes (TORCHELASTIC_ERROR_FILE), and the lines that
match `--duplicate-stdout/stderr-filters` in `attempt_<N>/filtered_{stdout,stderr}.log`.

A log file that cannot be written (disk full) is dropped: the launcher says so once, its lines go to
the console, and the workers' pipes keep draining, so a full disk never stalls a job.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, Optional, Union

from nccl_ddp.errors import ConfigError

log = logging.getLogger("nccl_ddp.launch")

OUT, ERR = 1, 2  # torchrun's Std: 0 none, 1 stdout, 2 stderr, 3 both
StdSpec = Union[int, dict]  # one value for every local rank, or {local_rank: value}


def parse_std(value: str, flag: str) -> StdSpec:
    """torchrun's `--redirects`/`--tee` value: `3`, or per local rank `0:1,1:2`."""
    try:
        if ":" not in value:
            std = int(value)
            if not 0 <= std <= 3:
                raise ValueError
            return std
        out: dict = {}
        for item in value.split(","):
            rank, _, each = item.partition(":")
            r, std = int(rank), int(each)
            if r < 0 or not 0 <= std <= 3:
                raise ValueError
            if r in out:  # torchrun lets the last one win, silently
                raise ConfigError(
                    f"{flag}={value!r}: local rank {r} is given twice ({r}:{out[r]} and {r}:{std}); "
                    "give each local rank once"
                )
            out[r] = std
        return out
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(
            f"{flag}={value!r}: use 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
            f"or per local rank, e.g. 0:3,1:2"
        ) from None


def check_local_ranks(
    nproc: int, redirects: StdSpec, tee: StdSpec, ranks_filter: Optional[frozenset]
) -> None:
    """Once the node's worker count is known: `--local-ranks-filter` must show some worker
    (a filter naming no local rank of this node hides every worker's output: refused); ranks it or
    a per-rank `--redirects`/`--tee` names that this node does not run are named in a warning."""
    if ranks_filter is not None:
        absent = sorted(r for r in ranks_filter if not 0 <= r < nproc)
        if len(absent) == len(ranks_filter):
            raise ConfigError(
                f"--local-ranks-filter={','.join(map(str, sorted(ranks_filter)))}: this node runs "
                f"local ranks 0..{nproc - 1}, so no worker's output would reach the console; "
                "name local ranks in that range (e.g. --local-ranks-filter=0), or drop the flag"
            )
        if absent:
            log.warning(
                "--local-ranks-filter: local ranks %s do not exist on this node (0..%d); showing %s",
                absent,
                nproc - 1,
                sorted(set(ranks_filter) - set(absent)),
            )
    for flag, spec in (("--redirects", redirects), ("--tee", tee)):
        absent = sorted(r for r in spec if r >= nproc) if isinstance(spec, dict) else []
        if absent:
            log.warning(
                "%s: local ranks %s do not exist on this node (0..%d); ignored", flag, absent, nproc - 1
            )


def std_of(spec: StdSpec, local_rank: int) -> int:
    return spec.get(local_rank, 0) if isinstance(spec, dict) else spec


class LogFile:
    """One stream's log; after a failed write (ENOSPC, EIO) it stops writing and says so once per
    job (`notice`), and `write` returns False so the caller sends the line elsewhere."""

    def __init__(self, path: str, notice: FullNotice):
        self.path, self._notice = path, notice
        self._f: Optional[IO[bytes]] = open(path, "wb", buffering=0)  # nothing left to flush

    def write(self, data: bytes) -> bool:
        if self._f is None:
            return False
        try:
            self._f.write(data)
            return True
        except (OSError, ValueError) as e:
            self._notice.say(self.path, e)
            self.close()
            return False

    def close(self) -> None:
        """Close without raising: a failing close must not skip the rest of the cleanup."""
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError as e:
                self._notice.say(self.path, e)


class FullNotice:
    """Says once per job that a log could not be written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.said = False

    def say(self, path: str, err: BaseException) -> None:
        with self._lock:
            if self.said:
                return
            self.said = True
        log.error(
            "cannot write the log %s (%s); from now on the output of any rank whose log "
            "fails goes to the console only",
            path,
            err,
        )


@dataclass
class WorkerLogs:
    """Where one worker's two streams go, and torch's error file for it."""

    console: tuple  # (stdout?, stderr?): forward to the launcher's console
    files: tuple  # (LogFile | None, LogFile | None)
    error_file: Optional[str]
    duplicates: tuple = (None, None)  # per stream: (filters, the attempt's shared LogFile)

    def close(self) -> None:
        for f in self.files:
            if f is not None:
                f.close()


class RunLogs:
    """The job's log directory (created at the first attempt) and each attempt's files."""

    def __init__(
        self,
        log_dir: Optional[str],
        run_id: str,
        redirects: StdSpec,
        tee: StdSpec,
        ranks_filter: Optional[frozenset],
        duplicate_filters: tuple = ((), ()),
    ):
        self.redirects, self.tee, self.filter = redirects, tee, ranks_filter
        self.duplicate_filters = duplicate_filters  # (stdout filters, stderr filters)
        self.notice = FullNotice()
        self.run_dir: Optional[str] = None
        self._shared: list = []
        if log_dir is None and (redirects or tee or any(duplicate_filters)):  # as torchrun
            log_dir = tempfile.mkdtemp(prefix="nccl-ddp-logs-")
        if log_dir is not None:
            try:
                os.makedirs(log_dir, exist_ok=True)
                self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=log_dir)
            except OSError as e:
                raise ConfigError(
                    f"--log-dir={log_dir}: cannot write the rank logs there ({e}); pass a writable directory"
                ) from e
            log.info("log directory: %s", self.run_dir)

    def attempt(self, attempt: int, nproc: int) -> list:
        """Open the logs of one attempt's workers (attempt_<N>/<local_rank>/...)."""
        opened: list = []
        try:
            dups: list = [None, None]
            for i, (filters, name) in enumerate(
                zip(self.duplicate_filters, ("filtered_stdout.log", "filtered_stderr.log"))
            ):
                if filters and self.run_dir is not None:
                    os.makedirs(os.path.join(self.run_dir, f"attempt_{attempt}"), exist_ok=True)
                    shared = LogFile(os.path.join(self.run_dir, f"attempt_{attempt}", name), self.notice)
                    self._shared.append(shared)
                    dups[i] = (tuple(filters), shared)
            for lr in range(nproc):
                opened.append(self._worker(attempt, lr))
                opened[-1].duplicates = tuple(dups)
        except OSError as e:
            for w in opened:
                w.close()
            self.end_attempt()
            raise ConfigError(
                f"--log-dir: cannot write the logs of attempt {attempt} in "
                f"{self.run_dir} ({e}); pass a writable directory with free "
                f"space"
            ) from e
        return opened

    def end_attempt(self) -> None:
        """Close the attempt's shared files (after every worker's output is drained)."""
        for f in self._shared:
            f.close()
        self._shared = []

    def _worker(self, attempt: int, lr: int) -> WorkerLogs:
        shown = self.filter is None or lr in self.filter
        redirected, teed = std_of(self.redirects, lr), std_of(self.tee, lr)
        console = tuple(shown and (not redirected & s or bool(teed & s)) for s in (OUT, ERR))
        if self.run_dir is None:
            return WorkerLogs(console, (None, None), None)
        rank_dir = os.path.join(self.run_dir, f"attempt_{attempt}", str(lr))
        os.makedirs(rank_dir, exist_ok=True)
        files = tuple(
            LogFile(os.path.join(rank_dir, name), self.notice) if (redirected | teed) & s else None
            for s, name in ((OUT, "stdout.log"), (ERR, "stderr.log"))
        )
        return WorkerLogs(console, files, os.path.join(rank_dir, "error.json"))
