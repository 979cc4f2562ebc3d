import os
import signal
import subprocess
import sys
import time

import pytest
from launch_run import TORCH_EXIT, run_launcher, wait_gone, write_script
from paths import ROOT

from nccl_ddp.errors import ConfigError
from nccl_ddp.launch.cli import parse_args
from nccl_ddp.launch.launcher import LaunchConfig, local_device_count, resolve_nproc

# Uses the job's store through the plain torchrun variables: nothing nccl_ddp-specific is passed.
TORCHRUN_STYLE = """
    import os, sys
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import connect_store
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    store = connect_store(resolve_env(), timeout=20)
    n = store.add("arrived", 1)
    store.barrier("all", world, timeout=20)
    print(f"hello {rank}/{world} local {local} port {os.environ['MASTER_PORT']}")
    print(f"err line {rank}", file=sys.stderr)
    store.close()
"""


def test_two_ranks_prefixed_output_and_logs(tmp_path):
    # torchrun's layout: LOG_DIR/<run id>_<random>/attempt_0/<local rank>/{stdout,stderr}.log
    script = write_script(tmp_path, TORCHRUN_STYLE)
    r = run_launcher(
        ["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "--rdzv-id", "job", script]
    )
    assert r.returncode == 0, r.stderr
    (run_dir,) = (tmp_path / "logs").glob("job_*")
    for rank in (0, 1):
        assert f"[rank {rank}] hello {rank}/2 local {rank} port " in r.stdout
        assert f"[rank {rank}] err line {rank}" in r.stderr
        logs = run_dir / "attempt_0" / str(rank)
        assert f"hello {rank}/2" in (logs / "stdout.log").read_text()
        assert (logs / "stderr.log").read_text() == f"err line {rank}\n"
    assert all(line.startswith("[rank ") for line in r.stdout.splitlines())


def test_module_entrypoint_and_args(tmp_path):
    write_script(tmp_path, "import sys, os; print(os.environ['RANK'], sys.argv[1:])", "mymod.py")
    r = run_launcher(
        ["--nproc-per-node", "2", "-m", "mymod", "--lr", "0.1"], env={"PYTHONPATH": str(tmp_path)}
    )
    assert r.returncode == 0, r.stderr
    assert "[rank 1] 1 ['--lr', '0.1']" in r.stdout


FAIL_FAST = """
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    out = sys.argv[1]
    if rank == 1:
        while not os.path.exists(os.path.join(out, "child0")):
            time.sleep(0.02)
        sys.exit(int(sys.argv[2]))
    if sys.argv[3] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(os.path.join(out, "pid0"), "w").write(str(os.getpid()))
    open(os.path.join(out, "child0"), "w").write(str(child.pid))
    time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["plain", "ignore-term"])
def test_failing_rank_stops_the_others(tmp_path, mode):
    script = write_script(tmp_path, FAIL_FAST)
    t0 = time.monotonic()
    r = run_launcher(["--nproc-per-node", "2", "--grace-period", "1", script, str(tmp_path), "3", mode])
    elapsed = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert "root cause: rank 1 (local rank 1): exit code 3" in r.stderr
    assert elapsed < 15
    pids = [int((tmp_path / f).read_text()) for f in ("pid0", "child0")]
    assert wait_gone(pids) == []


@pytest.mark.parametrize("mode", ["plain", "ignore-term"])
def test_sigterm_to_launcher_stops_everything(tmp_path, mode):
    script = write_script(
        tmp_path,
        """
        import os, signal, subprocess, sys, time
        if sys.argv[2] == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        rank = os.environ["RANK"]
        open(os.path.join(sys.argv[1], "pids" + rank), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(120)
    """,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_DDP_SECRET")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            "--grace-period",
            "60",
            script,
            str(tmp_path),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        files = [tmp_path / "pids0", tmp_path / "pids1"]
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.05)
        pids = [int(p) for f in files for p in f.read_text().split()]
        proc.send_signal(signal.SIGTERM)
        if mode == "ignore-term":  # workers ignore it: a second signal skips the grace period
            time.sleep(0.5)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM" in err
    assert wait_gone(pids) == []


def test_killed_by_signal_is_reported(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    """,
    )
    r = run_launcher(["--nproc-per-node", "2", script])
    assert r.returncode == 128 + signal.SIGKILL
    assert "root cause: rank 0 (local rank 0): killed by signal SIGKILL" in r.stderr


def test_two_standalone_jobs_do_not_collide(tmp_path):
    script = write_script(tmp_path, TORCHRUN_STYLE)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_DDP_SECRET")}
    cmd = [sys.executable, "-m", "nccl_ddp.launch", "--standalone", "--nproc-per-node", "2", script]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert [p.returncode for p in procs] == [0, 0], outs
    ports = {line.rsplit(" ", 1)[1] for out, _ in outs for line in out.splitlines()}
    assert len(ports) == 2


# ---- configuration ----------------------------------------------------------------------------


def test_env_fallbacks(monkeypatch):
    monkeypatch.setenv("NCCL_DDP_NPROC_PER_NODE", "3")
    monkeypatch.setenv("NCCL_DDP_GRACE_PERIOD", "0.5")
    monkeypatch.setenv("MASTER_PORT", "1234")
    cfg = parse_args(["train.py", "--epochs", "2"])
    assert (cfg.nproc_per_node, cfg.grace_period, cfg.master_port) == (3, 0.5, 1234)
    assert (cfg.entrypoint, cfg.args) == ("train.py", ("--epochs", "2"))
    cfg = parse_args(["--standalone", "train.py"])
    assert (cfg.master_addr, cfg.master_port) == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nproc_per_node=0), "nproc-per-node"),
        (dict(nproc_per_node="many"), "nproc-per-node"),
        (dict(nnodes=2, node_rank=2, master_addr="n0", master_port=5, secret="s"), "node-rank"),
        (dict(nnodes=2, node_rank=1, master_addr="n0", master_port=5), "NCCL_DDP_SECRET"),
        (dict(nnodes=2, node_rank=1, master_addr="n0", secret="s"), "master-port"),
        (dict(nnodes=2, node_rank=1, master_port=5, secret="s"), "master-addr"),
        (dict(master_port=70000), "master-port"),
        (dict(entrypoint=""), "no script"),
    ],
)
def test_invalid_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LaunchConfig(**dict(dict(entrypoint="train.py"), **kwargs))


def test_bad_config_exits_2_with_message(tmp_path):
    r = run_launcher(["--nnodes", "2", "--master-addr", "n0", "--master-port", "5", "x.py"])
    assert r.returncode == 2 and "NCCL_DDP_SECRET" in r.stderr


def test_auto_nproc(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert local_device_count() == 3 and resolve_nproc("auto") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_nproc("auto") == 2
    assert resolve_nproc(5) == 5


def test_auto_nproc_counts_gpus_with_nvml(monkeypatch):
    import types

    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetCount=lambda: 4,
        nvmlShutdown=lambda: calls.append("shutdown"),
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert resolve_nproc("auto") == 4
    assert calls == ["init", "shutdown"]

    def broken():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=broken))
    assert resolve_nproc("auto") == 2


@pytest.mark.slow
def test_allreduce_demo_through_the_launcher():
    demo = os.path.join(ROOT, "examples", "allreduce_demo.py")
    r = run_launcher(["--nproc-per-node", "2", demo])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 1] rank 1/2" in r.stdout and "expected 3.0" in r.stdout


TORCH_GLOO_AND_OURS = (
    """
    import numpy as np, torch, torch.distributed as dist
    import nccl_ddp as nd
    dist.init_process_group("gloo")          # env://: binds MASTER_PORT on rank 0, as under torchrun
    nd.init_process_group(backend="host", timeout=30)
    x = np.full(3, nd.get_rank() + 1.0, np.float32)
    nd.all_reduce(x)
    t = torch.full((3,), dist.get_rank() + 1.0)
    dist.all_reduce(t)
    print(f"ours {x.tolist()} torch {t.tolist()}")
    nd.destroy_process_group()
    dist.destroy_process_group()
"""
    + TORCH_EXIT
)  # not torch's teardown, which aborts now and then (launch_run.TORCH_EXIT)


@pytest.mark.slow
def test_torch_distributed_script_runs_unchanged(tmp_path):
    """MASTER_PORT is left to the script: torch.distributed's own store binds it while ours
    listens on NCCL_DDP_STORE_PORT, so a torchrun script can use both."""
    pytest.importorskip("torch")
    res = run_launcher(["--nproc-per-node", "2", write_script(tmp_path, TORCH_GLOO_AND_OURS)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in (0, 1):
        assert f"[rank {r}] ours [3.0, 3.0, 3.0] torch [3.0, 3.0, 3.0]" in res.stdout


# -- torchrun's command lines (issue 11) ---------------------------------------------------------


def test_torchrun_spellings_are_accepted():
    # before: exit 2 on --nproc_per_node, --rdzv_id, --rdzv_endpoint, --rdzv-backend, --max-restarts
    cfg = parse_args(
        [
            "--nnodes",
            "1:1",
            "--nproc_per_node",
            "2",
            "--rdzv_id",
            "job7",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "10.1.2.3:29511",
            "--max_restarts",
            "3",
            "--node_rank",
            "0",
            "--log_dir",
            "/tmp/x",
            "--grace_period",
            "1.5",
            "train.py",
            "--lr",
            "1",
        ]
    )
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.node_rank, cfg.max_restarts) == (2, 1, 0, 3)
    assert (cfg.master_addr, cfg.master_port, cfg.run_id) == ("10.1.2.3", 29511, "job7")
    assert (cfg.log_dir, cfg.grace_period, cfg.args) == ("/tmp/x", 1.5, ("--lr", "1"))
    dashed = parse_args(
        [
            "--nproc-per-node",
            "gpu",
            "--rdzv-backend",
            "static",
            "--rdzv-endpoint",
            "node0",
            "--max-restarts",
            "1",
            "--master_addr",
            "ignored",
            "t.py",
        ]
    )
    assert (dashed.nproc_per_node, dashed.master_addr, dashed.master_port) == ("auto", "node0", 29400)
    with pytest.raises(ConfigError, match="--rdzv-backend='etcd'"):
        parse_args(["--rdzv-backend", "etcd", "t.py"])
    with pytest.raises(SystemExit):
        parse_args(["--nnodes", "1:4", "t.py"])  # elastic ranges: a clear argparse error
    with pytest.raises(ConfigError, match="--max-restarts=-1"):
        parse_args(["--max-restarts", "-1", "t.py"])


CRASH_ONCE = """
    import os, sys
    import numpy as np
    import nccl_ddp as nd
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    assert restart == os.environ["NCCL_DDP_RESTART_COUNT"]
    rank = int(os.environ["RANK"])
    nd.init_process_group("host", timeout=20)
    x = nd.all_reduce(np.full(2, rank + 1.0, np.float32))
    if rank == 1 and restart == "0":
        sys.exit(5)                      # the first attempt crashes after using the store
    print(f"attempt {restart} sum {x[0]}")
    nd.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [0, 1])
def test_max_restarts_restarts_every_worker_after_a_failure(tmp_path, restarts):
    script = write_script(tmp_path, CRASH_ONCE)
    r = run_launcher(
        ["--nproc_per_node", "2", "--max-restarts", str(restarts), "--grace-period", "2", script], timeout=120
    )
    if restarts == 0:
        assert r.returncode == 5, r.stderr
        assert "restart 1 of" not in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restart 1 of 1: rank 1 (local rank 1): exit code 5; restarting all 2 worker(s)" in r.stderr, (
        r.stderr
    )
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 1 sum 3.0" in r.stdout, r.stdout
    assert "[rank 1] attempt 0" not in r.stdout


# -- every torchrun flag and variable (issue 21) -------------------------------------------------

ALL_TORCHRUN_FLAGS = [
    "--nnodes",
    "1",
    "--nproc-per-node",
    "2",
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    "localhost:0",
    "--rdzv-id",
    "j1",
    "--rdzv-conf",
    "join_timeout=900,last_call_timeout=5",
    "--max-restarts",
    "1",
    "--monitor-interval",
    "0.5",
    "--start-method",
    "fork",
    "--event-log-handler",
    "null",
    "--role",
    "trainer",
    "--log-dir",
    "/tmp/l",
    "-r",
    "0:1",
    "-t",
    "1:2",
    "--local-ranks-filter",
    "0,1",
    "--duplicate-stdout-filters",
    "a,b",
    "--duplicate-stderr-filters",
    "c",
    "--node-rank",
    "0",
    "--master-addr",
    "127.0.0.1",
    "--master-port",
    "29511",
    "--local-addr",
    "10.0.0.1",
    "--logs-specs",
    "mine",
    "--numa-binding",
    "node",
    "--signals-to-handle",
    "SIGTERM,SIGUSR1",
    "--shutdown-timeout",
    "7",
    "--virtual-local-rank",
    "--no-python",
    "train.sh",
    "--lr",
    "1",
]


def test_every_torchrun_flag_is_accepted(caplog):
    # before: "unrecognized arguments" (exit 2) for --tee, --redirects, --role, --rdzv-conf, ...
    caplog.set_level("WARNING", logger="nccl_ddp.launch")
    cfg = parse_args(ALL_TORCHRUN_FLAGS)
    assert (cfg.role, cfg.monitor_interval, cfg.run_id, cfg.join_timeout) == ("trainer", 0.5, "j1", 900.0)
    assert (cfg.redirects, cfg.tee, cfg.local_ranks_filter) == ({0: 1}, {1: 2}, {0, 1})
    assert (cfg.grace_period, cfg.no_python, cfg.virtual_local_rank) == (7.0, True, True)
    assert [s.name for s in cfg.signals] == ["SIGTERM", "SIGUSR1"]
    assert (cfg.entrypoint, cfg.args, cfg.master_port) == ("train.sh", ("--lr", "1"), 0)
    notices = " | ".join(r.getMessage() for r in caplog.records)
    for flag in ("last_call_timeout", "--logs-specs", "--numa-binding", "--local-addr"):
        assert flag in notices, notices
    assert len(caplog.records) == 4, notices  # one line each
    assert cfg.duplicate_filters == (("a", "b"), ("c",))


def test_torchrun_flag_values_are_checked_and_pet_variables_read(monkeypatch):
    for bad, match in (
        (["--tee", "4"], "--tee='4'"),
        (["--redirects", "0:x"], "--redirects"),
        (["--local-ranks-filter", "a"], "local-ranks-filter"),
        (["--rdzv-conf", "join_timeout"], "key=value"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL"),
        (["--monitor-interval", "0"], "monitor-interval"),
        (["--run-path", "rel.py"], "absolute path"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_args(bad + ["rel.py"] if bad[0] != "--run-path" else bad)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_STANDALONE", "1")
    cfg = parse_args(["t.py"])
    assert cfg.nproc_per_node == 3 and cfg.standalone and cfg.run_id not in ("", "none")
    monkeypatch.delenv("PET_STANDALONE")
    monkeypatch.setenv("NCCL_DDP_SECRET", "s")
    assert parse_args(["--log-dir", "d", "t.py"]).tee == 3  # --log-dir alone: tee both
    assert parse_args(["--log-dir", "d", "-r", "3", "t.py"]).tee == 0
    assert (
        parse_args(
            ["--nnodes", "2", "--rdzv-backend", "c10d", "--master-addr", "n0", "--master-port", "5", "t.py"]
        ).node_rank
        is None
    )


def test_redirects_tee_and_filter_route_each_stream(tmp_path):
    from nccl_ddp.launch.logs import RunLogs

    logs = RunLogs(str(tmp_path), "r", {0: 3, 1: 1}, {1: 2}, frozenset({0, 1}))
    w0, w1, w2 = logs.attempt(0, 3)
    assert w0.console == (False, False) and all(f is not None for f in w0.files)  # redirected
    assert w1.console == (False, True) and all(f is not None for f in w1.files)  # 1 out, tee err
    assert w2.console == (False, False) and w2.files == (None, None)  # filtered out
    assert w2.error_file.endswith(os.path.join("attempt_0", "2", "error.json"))
    for w in (w0, w1, w2):
        w.close()


TORCHTITAN = """
    import os, sys
    names = ("RANK", "LOCAL_RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")
    print(" ".join(f"{n}={os.environ[n]}" for n in names), sys.argv[1:])
    print("error file", os.environ["TORCHELASTIC_ERROR_FILE"], file=sys.stderr)
"""


@pytest.mark.slow
def test_torchtitan_run_train_line_runs(tmp_path):
    """torchtitan's run_train.sh (NGPU=2, LOG_RANK=0), with torchrun replaced by us."""
    pkg = tmp_path / "torchtitan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(pkg, TORCHTITAN, "train.py")
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp_path),
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    }
    env.pop("OMP_NUM_THREADS", None)
    full = dict(os.environ, **env)
    full.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc_per_node=2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter",
            "0",
            "--role",
            "rank",
            "--tee",
            "3",
            "-m",
            "torchtitan.train",
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()  # rank 1 is filtered off the console
    assert line.startswith(
        "[rank 0] RANK=0 LOCAL_RANK=0 ROLE_NAME=rank ROLE_RANK=0 "
        "ROLE_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1 "
        "TORCHELASTIC_RUN_ID=none OMP_NUM_THREADS=1 "
    ), line
    assert line.endswith("['--module', 'llama3', '--config', 'llama3_debugmodel']")
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in r.stderr
    (run_dir,) = tmp_path.glob("nccl-ddp-logs-*/none_*")  # --tee without --log-dir
    out1 = (run_dir / "attempt_0" / "1" / "stdout.log").read_text()
    assert out1.startswith("RANK=1 LOCAL_RANK=1 ROLE_NAME=rank ROLE_RANK=1 ")
    err0 = (run_dir / "attempt_0" / "0" / "stderr.log").read_text()
    assert err0 == f"error file {run_dir / 'attempt_0' / '0' / 'error.json'}\n"


@pytest.mark.slow
def test_standalone_run_id_and_omp_left_alone_when_set(tmp_path):
    script = write_script(
        tmp_path, "import os; print(os.environ['TORCHELASTIC_RUN_ID'], os.environ['OMP_NUM_THREADS'])"
    )
    r = run_launcher(["--standalone", "--nproc-per-node", "2", script], env={"OMP_NUM_THREADS": "3"})
    assert r.returncode == 0, r.stderr
    ids = {line.split()[2] for line in r.stdout.splitlines()}
    assert len(ids) == 1 and len(ids.pop()) == 36  # one uuid4 per job
    assert {line.split()[3] for line in r.stdout.splitlines()} == {"3"}
    assert "OMP_NUM_THREADS" not in r.stderr


@pytest.mark.slow
def test_duplicate_filters_copy_matching_lines(tmp_path):
    script = write_script(
        tmp_path,
        """
        import sys
        print("step 1 loss 3.5"); print("noise"); print("a,b")
        print("step 1 on stderr", file=sys.stderr)
    """,
    )
    r = run_launcher(
        [
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "--duplicate-stdout-filters",
            "step,a,,b",
            "--duplicate-stderr-filters",
            "stderr",
            script,
        ]
    )
    assert r.returncode == 0, r.stderr
    (attempt,) = (tmp_path / "logs").glob("*/attempt_0")
    out = sorted((attempt / "filtered_stdout.log").read_text().splitlines())
    assert out == [f"[rank {r}] {t}" for r in (0, 1) for t in ("a,b", "step 1 loss 3.5")], out
    err = sorted((attempt / "filtered_stderr.log").read_text().splitlines())
    assert err == ["[rank 0] step 1 on stderr", "[rank 1] step 1 on stderr"], err


TORCH_RECORD = """
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch 17 (lost peer rank 0 earlier)")

    main()
"""


@pytest.mark.slow
def test_summary_reads_torch_record_error_file(tmp_path):
    # before: TORCHELASTIC_ERROR_FILE unset: torch's record only logged; the summary said
    # "rank 1 (local rank 1): exit code 1" with no reason
    pytest.importorskip("torch")
    r = run_launcher(["--nproc-per-node", "2", write_script(tmp_path, TORCH_RECORD)], timeout=120)
    assert r.returncode == 1, r.stderr
    assert (
        "root cause: rank 1 (local rank 1): exit code 1: ValueError: bad batch 17 (lost "
        "peer rank 0 earlier) [blames rank 0]"
    ) in r.stderr, r.stderr


@pytest.mark.slow
def test_run_path_no_python_and_virtual_local_rank(tmp_path):
    script = write_script(
        tmp_path,
        "import os, sys; print(__name__, sys.argv, os.environ['LOCAL_RANK'],"
        " os.environ['CUDA_VISIBLE_DEVICES'])",
    )
    r = run_launcher(
        ["--nproc-per-node", "2", "--run-path", "--virtual-local-rank", script, "x"],
        env={"CUDA_VISIBLE_DEVICES": "3,5"},
    )
    assert r.returncode == 0, r.stderr
    assert f"[rank 1] __main__ ['{script}', 'x'] 0 5" in r.stdout, r.stdout
    prog = tmp_path / "prog.sh"
    prog.write_text("#!/bin/sh\necho shell $RANK $1\n")
    prog.chmod(0o755)
    r = run_launcher(["--nproc-per-node", "2", "--no-python", str(prog), "y"])
    assert r.returncode == 0, r.stderr
    assert "[rank 1] shell 1 y" in r.stdout


def test_signals_ignored_at_start_stay_ignored():
    """Under nohup SIGHUP is ignored: the launcher must not start handling it (and stop the job)."""
    from nccl_ddp.launch.supervisor import Signals

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Signals((signal.SIGHUP, signal.SIGUSR1)) as sigs:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert sigs.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--grace-period", "nan"], r"--grace-period=nan: use a finite number"),
        (["--shutdown-timeout", "inf"], r"--grace-period=inf: use a finite number"),
        (["--monitor-interval", "inf"], r"--monitor-interval=inf: use a finite number"),
        (["--monitor-interval", "1e9"], r"--monitor-interval=1000000000.0: use seconds > 0 and at most 3600"),
        (["--rdzv-conf", "join_timeout=nan"], r"join_timeout=nan: use a finite number"),
        (["--rdzv-conf", "join_timeout=inf"], r"join_timeout=inf: use a finite number"),
        (["--rdzv-conf", "is_host=maybe"], r"is_host='maybe' is not a boolean"),
        (
            ["--local-ranks-filter=-1"],
            r"--local-ranks-filter='-1': use comma-separated local ranks \(0 or",
        ),
        (["--redirects", "0:1,0:2"], r"local rank 0 is given twice \(0:1 and 0:2\)"),
        (["--tee", "1:3,1:0"], r"--tee='1:3,1:0': local rank 1 is given twice"),
        (["--redirects=-1:3"], r"--redirects=.-1:3.: use 0"),
    ],
)
def test_non_finite_and_ambiguous_launcher_values_are_refused(args, match):
    """Before: nan/inf seconds were accepted (a grace period of nan never escalated to SIGKILL,
    an interval of inf crashed in time.sleep), is_host=maybe meant False, -1 hid every worker's
    output and a local rank given twice let the last value win, all silently."""
    with pytest.raises(ConfigError, match=match):
        parse_args([*args, "t.py"])


def test_rdzv_conf_booleans_read_as_torchrun_reads_them(monkeypatch):
    for text, want in (("1", True), ("T", True), ("yes", True), ("0", False), ("f", False), ("No", False)):
        assert parse_args(["--rdzv-conf", f"is_host={text}", "t.py"]).is_host is want
    monkeypatch.setenv("NCCL_DDP_GRACE_PERIOD", "nan")  # the environment fallback is checked too
    with pytest.raises(ConfigError, match="--grace-period=nan"):
        parse_args(["t.py"])


def test_local_ranks_this_node_lacks_are_refused_or_named(caplog):
    from nccl_ddp.launch.logs import check_local_ranks

    caplog.set_level("WARNING", logger="nccl_ddp.launch")
    with pytest.raises(ConfigError, match=r"--local-ranks-filter=2,5: this node runs local ranks 0..1"):
        check_local_ranks(2, 0, 0, frozenset({2, 5}))  # would hide every worker's output
    assert not caplog.records
    check_local_ranks(2, {0: 1, 3: 2}, 0, frozenset({0, 5}))
    text = " | ".join(r.getMessage() for r in caplog.records)
    assert "--local-ranks-filter: local ranks [5] do not exist on this node (0..1); showing [0]" in text
    assert "--redirects: local ranks [3] do not exist on this node (0..1); ignored" in text
    caplog.clear()
    check_local_ranks(2, 3, {0: 1, 1: 2}, frozenset({0, 1}))
    assert not caplog.records


def test_local_ranks_filter_beyond_the_node_exits_2_before_starting(tmp_path):
    script = write_script(tmp_path, "raise SystemExit('worker started')\n")
    r = run_launcher(["--nproc-per-node", "2", "--local-ranks-filter", "2", script])
    assert r.returncode == 2, r.stderr
    assert "no worker's output would reach the console" in r.stderr
    assert "worker started" not in r.stderr


@pytest.mark.slow
def test_long_monitor_interval_still_sees_exits_and_signals(tmp_path):
    """--monitor-interval 3600: the launcher sleeps in slices, so it returns as soon as its
    workers exit and stops them at once on SIGTERM. Before: it slept the whole interval in one
    time.sleep, which resumes after the signal handler (only SIGKILL ended it)."""
    quick = write_script(tmp_path, "print('done')\n", name="quick.py")
    r = run_launcher(["--nproc-per-node", "1", "--monitor-interval", "3600", quick], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "[rank 0] done" in r.stdout
    sleeper = write_script(
        tmp_path,
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], "pid"), "w").write(str(os.getpid()))
        time.sleep(120)
        """,
        name="sleeper.py",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_DDP_SECRET")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "1", "--monitor-interval", "3600"]
        + [sleeper, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        pid_file = tmp_path / "pid"
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the worker did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert wait_gone([int(pid_file.read_text())]) == []
