"""The launcher's workers: start them, pump their output, stop them all on the first failure, and
say which rank failed first for a reason of its own (the root cause) and which failed because of it.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any, Callable, Optional

from nccl_ddp.errors import ConfigError
from nccl_ddp.job.failure_record import FailureRecord
from nccl_ddp.launch.logs import LogFile, WorkerLogs

log = logging.getLogger("nccl_ddp.launch")

POLL_INTERVAL = 0.05
LINE_CAP = 64 << 10  # bytes of one output line; longer ones are split with a marker
SPLIT_MARKER = b" [nccl-ddp-run: line split at 64 KiB]\n"
GATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate.py")


class WorkerState(str, enum.Enum):
    """Life of one worker process as the launcher sees it.

        INIT --start--> RUNNING --exit 0-----------------> SUCCEEDED
                           |----exit != 0 or signal----> FAILED
                           '--stop--> STOPPING --exit--> STOPPED

    STOPPED means the launcher stopped it (another rank failed or the launcher got a signal);
    its exit code does not count as a failure.
    """

    INIT = "INIT"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Worker:
    """One worker process in its own process group, with its output pumped through a prefix."""

    def __init__(
        self,
        rank: int,
        local_rank: int,
        error_file: Optional[str] = None,
        torch_error_file: Optional[str] = None,
    ):
        self.rank, self.local_rank = rank, local_rank
        self.error_file = error_file  # where the worker records why it failed
        self.torch_error_file = torch_error_file  # TORCHELASTIC_ERROR_FILE (torch's record)
        self.state = WorkerState.INIT
        self.returncode: Optional[int] = None
        self.exit_time: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None
        self._pumps: list[threading.Thread] = []
        self.logs: Optional[WorkerLogs] = None

    def start(
        self,
        cmd: list[str],
        env: dict,
        logs: WorkerLogs,
        out_lock: threading.Lock,
        announce: Callable[[int], None],
    ) -> None:
        """Start the worker held at a gate (gate.py), `announce` its process group (to the
        reaper), then release it: no user code runs before the reaper knows the process."""
        read_end, write_end = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", GATE, str(read_end), str(os.getpid())] + cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(read_end,),
                start_new_session=True,
            )  # own group: grandchildren too
        finally:
            os.close(read_end)
        try:
            announce(self.proc.pid)
            os.write(write_end, b"g")
        finally:
            os.close(write_end)
        self.logs = logs
        prefix = f"[rank {self.rank}] ".encode()
        for pipe, sink, shown, file, dup in zip(
            (self.proc.stdout, self.proc.stderr),
            (sys.stdout, sys.stderr),
            logs.console,
            logs.files,
            logs.duplicates,
        ):
            t = threading.Thread(
                target=_pump,
                args=(pipe, sink, shown, prefix, file, out_lock, dup),
                daemon=True,
                name=f"nccl-ddp-run-pump-{self.rank}",
            )
            t.start()
            self._pumps.append(t)
        self.state = WorkerState.RUNNING

    def poll(self) -> bool:
        """Update the state from the process; True if the worker just finished."""
        if self.state not in (WorkerState.RUNNING, WorkerState.STOPPING) or self.proc is None:
            return False
        code = self.proc.poll()
        if code is None:
            return False
        self.returncode, self.exit_time = code, time.time()
        if self.state is WorkerState.STOPPING:
            self.state = WorkerState.STOPPED
        else:
            self.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
        return True

    def signal(self, sig: int, stopping: bool = True) -> None:
        """Send `sig` to the worker's whole process group."""
        if self.proc is None:
            return
        if self.state is WorkerState.RUNNING and stopping:
            self.state = WorkerState.STOPPING
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone

    def finish(self, timeout: float = 2.0) -> None:
        """Wait for the output pumps, then close the logs (never raises)."""
        for t in self._pumps:
            t.join(timeout)
        if self.logs is not None:
            self.logs.close()

    def record(self) -> Optional[FailureRecord]:
        """Why the worker failed: its nccl_ddp record (nccl_ddp.job.failure_record), else the one
        torch's `record` decorator wrote to TORCHELASTIC_ERROR_FILE, if any."""
        rec = FailureRecord.read(self.error_file)
        if rec is not None:
            return rec
        return FailureRecord.read_torch(self.torch_error_file)

    def describe(self) -> str:
        text = f"rank {self.rank} (local rank {self.local_rank}): {describe_exit(self.returncode)}"
        rec = self.record()
        if rec:
            text += f": {rec.type}: {rec.message[:500]}"
            if rec.blames is not None:
                text += f" [blames rank {rec.blames}]"
        return text


def _pump(
    pipe: IO[bytes],
    sink: IO,
    shown: bool,
    prefix: bytes,
    log_file: Optional[LogFile],
    lock: threading.Lock,
    duplicate: Optional[tuple] = None,
) -> None:
    """Copy one worker stream line by line to the console (when `shown`, or once its log file
    failed), to its log, and to the attempt's `duplicate` file when a filter matches (filters,
    LogFile); never stop draining the pipe, whatever the sinks do."""
    out = getattr(sink, "buffer", None)
    sink_ok = True
    wanted = [f.encode() for f in duplicate[0]] if duplicate else []
    for line in iter(lambda: pipe.readline(LINE_CAP), b""):
        if not line.endswith(b"\n"):  # a line over the cap (or the last one, unterminated)
            line += SPLIT_MARKER if len(line) == LINE_CAP else b"\n"
        logged = log_file is not None and log_file.write(line)
        if duplicate and any(w in line for w in wanted):
            with lock:
                duplicate[1].write(prefix + line)
        if not (shown or (log_file is not None and not logged)) or not sink_ok:
            continue
        with lock:
            try:
                if out is not None:
                    out.write(prefix + line)
                else:
                    sink.write((prefix + line).decode(errors="replace"))
                sink.flush()
            except (OSError, ValueError):  # our stdout went away: keep draining the worker
                sink_ok = False
    pipe.close()


DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle


def parse_signals(names: str) -> tuple:
    """`--signals-to-handle`: comma-separated names (SIGUSR1 or USR1)."""
    out = []
    for name in filter(None, (n.strip().upper() for n in names.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal, full, None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"--signals-to-handle: {name!r} is not a signal the launcher can "
                f"catch; use names such as {DEFAULT_SIGNALS}"
            )
        out.append(sig)
    return tuple(out)


class Signals:
    """Records the handled signals (torchrun's --signals-to-handle) for the launcher while
    installed (main thread only): the whole run, so one between two attempts stops it cleanly."""

    def __init__(self, handled: tuple = (signal.SIGTERM, signal.SIGINT)):
        self.handled = handled
        self.received: Optional[int] = None  # the first signal
        self.count = 0  # a second one skips the grace period
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.handled:
                if signal.getsignal(sig) is signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                    continue
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@dataclass
class Outcome:
    """How one attempt ended: exit code for the launcher, root cause first among the failures."""

    code: int
    failures: list = field(default_factory=list)  # FAILED workers, root cause first
    signal: Optional[int] = None  # the signal the launcher got, if any
    elsewhere: Optional[str] = None  # why another node ended the attempt

    @property
    def root(self) -> Optional[Worker]:
        """The worker that failed by itself first (None: the job was stopped by a signal)."""
        first = self.failures[0] if self.failures else None
        return first if first is not None and first.state is WorkerState.FAILED else None


def order_failures(failed: list) -> list:
    """Root cause first: a rank that no failure record blames on another rank (killed, or failed
    for its own reason), preferring ranks others blame, earliest first; then the ranks that
    failed because of it."""
    records = {w.rank: w.record() for w in failed}
    blamed = {r.blames for r in records.values() if r}

    def key(w: Worker) -> tuple:
        rec = records[w.rank]
        caused = rec is not None and rec.blames not in (None, w.rank)
        when = rec.time if rec is not None and rec.time is not None else w.exit_time
        return caused, w.rank not in blamed, when or 0.0, w.rank

    return sorted(failed, key=key)


def supervise(
    workers: list,
    signals: Signals,
    grace: float,
    interval: float = POLL_INTERVAL,
    elsewhere: Callable[[], Optional[str]] = lambda: None,
) -> Outcome:
    """Wait for the workers, looking every `interval` seconds; stop them all on the first
    failure, signal, or when `elsewhere()` says another node ended the attempt (its reason).

    Stopping: SIGTERM (or the signal the launcher got) to every worker's process group, SIGKILL
    after `grace` seconds or at once when a second signal arrives."""
    first: Optional[Worker] = None
    stop_deadline: Optional[float] = None
    killed = False
    remote: Optional[str] = None
    while True:
        for w in workers:
            if w.poll() and w.state is WorkerState.FAILED and first is None:
                first = w
        if stop_deadline is None and first is None and signals.received is None:
            remote = elsewhere()
        if stop_deadline is None and (
            first is not None or signals.received is not None or remote is not None
        ):
            sig: int
            if remote is not None and first is None and signals.received is None:
                log.error("%s; stopping this node's workers", remote)
                sig = signal.SIGTERM
            elif first is not None:
                log.error(
                    "rank %d (local rank %d) exited (%s); stopping the other workers",
                    first.rank,
                    first.local_rank,
                    describe_exit(first.returncode),
                )
                sig = signal.SIGTERM
            else:
                sig = int(signals.received or signal.SIGTERM)
                log.warning("received %s; forwarding it to the workers", signal.Signals(sig).name)
            for w in workers:
                w.signal(sig)
            stop_deadline = time.monotonic() + grace
        if all(w.state not in (WorkerState.RUNNING, WorkerState.STOPPING) for w in workers):
            break
        if (
            stop_deadline is not None
            and not killed
            and (time.monotonic() > stop_deadline or signals.count > 1)
        ):
            for w in workers:
                if w.state is WorkerState.STOPPING:
                    w.signal(signal.SIGKILL)
            killed = True
        _pause(workers, signals, interval)
    if stop_deadline is not None:
        for w in workers:  # grandchildren left in a stopped worker's group
            w.signal(signal.SIGKILL, stopping=False)
    # a stopped worker that recorded a failure of its own failed too (before the stop reached it);
    # the root cause is a worker that failed by itself, since its failure started the stop
    ordered = order_failures(
        [
            w
            for w in workers
            if w.state is WorkerState.FAILED or (w.state is WorkerState.STOPPED and w.record())
        ]
    )
    root = next((w for w in ordered if w.state is WorkerState.FAILED), None)
    failures = ([root] if root else []) + [w for w in ordered if w is not root]
    if root is not None:
        code = root.returncode or 0
        return Outcome(code if code > 0 else 128 - code, failures, signals.received)
    if signals.received is not None:
        return Outcome(128 + signals.received, failures, signals.received)
    if remote is not None:
        return Outcome(1, failures, elsewhere=remote)
    return Outcome(0)


def _pause(workers: list, signals: Signals, interval: float) -> None:
    """Sleep up to `interval` seconds in slices of `POLL_INTERVAL`, ending early when a signal
    arrives or a worker exits: a long --monitor-interval never delays the launcher's answer to
    either (`time.sleep` itself resumes after a signal's handler, and would sleep on)."""
    end, count = time.monotonic() + interval, signals.count
    while True:
        left = end - time.monotonic()
        if left <= 0 or signals.count != count:
            return
        if any(w.proc is not None and w.proc.poll() is not None for w in workers if w.state in _LIVE):
            return
        time.sleep(min(left, POLL_INTERVAL))


_LIVE = (WorkerState.RUNNING, WorkerState.STOPPING)


def report(outcome: Outcome) -> None:
    """Log the root cause first, then the ranks that failed because of it."""
    root = outcome.root
    if root is not None:
        log.error("job failed; root cause: %s", root.describe())
    for w in outcome.failures[1 if root else 0 :]:
        log.error("  then %s", w.describe())
