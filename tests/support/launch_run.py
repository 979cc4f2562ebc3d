"""Running the launcher in tests (tests/launch): `run_launcher` runs `python -m nccl_ddp.launch
ARGS` without the caller's job variables, `write_script` writes a worker script, `alive`/`wait_gone`
watch the processes it started."""

import os
import subprocess
import sys
import textwrap
import time

# The last lines of a worker script that used torch.distributed (gloo): leave without the
# interpreter's teardown, where torch's own threads now and then abort the process after
# destroy_process_group() ("terminate called without an active exception", SIGABRT: about 1 run
# in 40 under torchrun too). A test judges what it tests (the output, our notices), not that.
TORCH_EXIT = """
    import os as _os, sys as _sys
    _sys.stdout.flush(); _sys.stderr.flush()
    _os._exit(0)
"""


def write_script(tmp_path, body, name="worker.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run_launcher(args, timeout=60, env=None, **kw):
    full_env = dict(os.environ, **(env or {}))
    for var in ("MASTER_ADDR", "MASTER_PORT", "NCCL_DDP_SECRET", "RANK", "WORLD_SIZE"):
        full_env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "nccl_ddp.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        **kw,
    )


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def run_together(commands, envs, timeout=90):
    """Start every command (its env from `envs`, one each) at once, wait for all; returns (the
    processes, their (stdout, stderr)). Nothing outlives the call."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for cmd, env in zip(commands, envs)
    ]
    return procs, wait_all(procs, timeout)


def wait_all(procs, timeout):
    """Every process's (stdout, stderr) once it ended; any still running after `timeout` (or on
    an error) is killed."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
