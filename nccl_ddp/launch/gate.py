"""A worker's first moments: wait until the launcher has told the reaper about this process, then
become the worker (exec, same pid and process group).

`python -I -S gate.py FD CMD...`: one byte on FD releases it; end of input (the launcher died
before releasing it) ends it before any user code ran, so no worker exists that the reaper does not
know (run as a file, stdlib only, so it starts at once).
"""

import os
import sys


def main() -> None:
    fd = int(sys.argv[1])
    go = os.read(fd, 1)
    os.close(fd)
    if not go:
        sys.exit(1)
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
