"""A worker's first moments: wait until the launcher has told the reaper about this process, then
become the worker (exec, same pid and process group).

`python -I -S gate.py FD LAUNCHER_PID CMD...`: one byte on FD releases it; end of input (the
launcher died before releasing it) ends it before any user code ran, so no worker exists that the
reaper does not know (run as a file, stdlib only, so it starts at once). The worker also dies with
the launcher by itself (Linux's parent-death signal, kept across exec): a second line of defence
for when the reaper is gone too.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with(launcher_pid: int) -> None:
    """SIGKILL this process when the launcher's thread that started it ends; exit now if the
    launcher is already gone (the signal is only sent for a death after the call)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # no prctl (not Linux): the reaper alone
    if os.getppid() != launcher_pid:
        sys.exit(1)


def main() -> None:
    fd, launcher_pid = int(sys.argv[1]), int(sys.argv[2])
    die_with(launcher_pid)
    go = os.read(fd, 1)
    os.close(fd)
    if not go:
        sys.exit(1)
    os.execvp(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
