"""Failure detection times: how long the job takes to notice and act on a dead rank or launcher.

    python scripts/bench_faults.py [--repeats 3]

Runs small 2-rank jobs through nccl-ddp-run and measures, for each transport:
  peer_detect_s  rank 1 SIGKILLed mid all-reduce -> rank 0's collective raises naming it
  job_exit_s     the same kill -> the launcher has stopped every worker and exited
  orphan_kill_s  the launcher SIGKILLed -> its workers are gone (the reaper)
Writes out/bench_faults.csv.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402

VICTIM = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import nccl_ddp as nd
    out = sys.argv[1]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # rank 0 detects by itself, not by the stop
    nd.init_process_group("host", timeout=30)
    rank = nd.get_rank()
    try:
        for step in range(100000):
            if rank == 1 and step == 50:
                open(os.path.join(out, "killed"), "w").write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            nd.all_reduce(np.ones(1 << 14, np.float32))
    except Exception:
        open(os.path.join(out, "detected"), "w").write(repr(time.time()))
        raise
""")

SLEEPER = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
    time.sleep(60)
""")


def _launch(script: str, out: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            "--grace-period",
            "5",
            script,
            out,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_DDP_SECRET")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        victim, sleeper = os.path.join(tmp, "victim.py"), os.path.join(tmp, "sleeper.py")
        open(victim, "w").write(VICTIM)
        open(sleeper, "w").write(SLEEPER)
        for transport in ("shm", "tcp"):
            detect, exits = [], []
            for _ in range(a.repeats):
                out = tempfile.mkdtemp(dir=tmp)
                proc = _launch(victim, out, dict(base, NCCL_DDP_HOST_TRANSPORT=transport))
                proc.wait(120)
                end = time.time()
                killed = float(open(os.path.join(out, "killed")).read())
                detect.append(float(open(os.path.join(out, "detected")).read()) - killed)
                exits.append(end - killed)
            rows.append(
                {
                    "transport": transport,
                    "peer_detect_s": statistics.median(detect),
                    "job_exit_s": statistics.median(exits),
                }
            )
        orphans = []
        for _ in range(a.repeats):
            out = tempfile.mkdtemp(dir=tmp)
            proc = _launch(sleeper, out, base)
            files = [os.path.join(out, f"pid{r}") for r in (0, 1)]
            while not all(os.path.exists(f) and open(f).read() for f in files):
                time.sleep(0.01)
            pids = [int(open(f).read()) for f in files]
            t0 = time.time()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            while any(_alive(pid) for pid in pids) and time.time() - t0 < 30:
                time.sleep(0.005)
            orphans.append(time.time() - t0)
        rows.append({"transport": "-", "orphan_kill_s": statistics.median(orphans)})
    print(
        format_table(
            rows,
            ["transport", "peer_detect_s", "job_exit_s", "orphan_kill_s"],
            {"peer_detect_s": ".3f", "job_exit_s": ".2f", "orphan_kill_s": ".3f"},
        )
    )
    os.makedirs("out", exist_ok=True)
    write_csv(rows, "out/bench_faults.csv")


if __name__ == "__main__":
    main()
