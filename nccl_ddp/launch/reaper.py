"""A watchdog process that cleans up after a launcher that died (SIGKILL, OOM killer).

The launcher starts it with a pipe on its stdin and writes one line per event: `pgid N` for each
worker process group it starts (before the worker may run any code: see gate.py), `dir PATH`
for its record directory, `done` when it exits normally. End of input without `done` means the
launcher is gone: the reaper kills every worker group (the workers and their children), removes
the job's record directory, and says so on stderr (the launcher's terminal: the workers' own
output died with the launcher's pumps). Shared-memory segments have no name to remove (see
comm/host/shm.py): they go with the last process that maps them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import IO, Optional


class Reaper:
    """The launcher's side: start the watchdog and tell it what to clean."""

    def __init__(self, launcher_pid: int) -> None:
        self._proc: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(launcher_pid)],  # stdlib only
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # Ctrl-C at the terminal goes to the launcher only

    def _say(self, line: str) -> None:
        stdin = self._proc.stdin if self._proc is not None else None
        if stdin is None:
            return
        try:
            stdin.write(f"{line}\n".encode())
            stdin.flush()
        except OSError:
            pass

    def watch_group(self, pgid: int) -> None:
        self._say(f"pgid {pgid}")

    def watch_dir(self, path: str) -> None:
        self._say(f"dir {path}")

    def close(self) -> None:
        """The launcher cleaned up itself: the reaper exits without touching anything."""
        if self._proc is None:
            return
        self._say("done")
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None


def watch(stream: IO[bytes], launcher_pid: int) -> int:
    groups, dirs = [], []
    for raw in iter(stream.readline, b""):
        word, _, arg = raw.decode(errors="replace").strip().partition(" ")
        if word == "done":
            return 0
        if word == "pgid":
            groups.append(int(arg))
        elif word == "dir":
            dirs.append(arg)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    sys.stderr.write(
        f"nccl-ddp-run: the launcher (pid {launcher_pid}) died without stopping its "
        f"workers; killed their {len(groups)} process group(s)\n"
    )
    return 1


def main() -> None:
    """The watchdog process: `python reaper.py LAUNCHER_PID`, the pipe on stdin (run as a file,
    so it starts at once: it imports no package)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(watch(sys.stdin.buffer, int(sys.argv[1])))


if __name__ == "__main__":
    main()
