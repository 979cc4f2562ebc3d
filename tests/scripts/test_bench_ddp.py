"""scripts/bench_ddp.py runs end to end (tiny model, 2 host ranks) and writes its CSV."""

import csv
import os
import subprocess
import sys

import pytest
from paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "bench_ddp.py")


@pytest.mark.slow
def test_bench_ddp_smoke(tmp_path):
    out = tmp_path / "bench.csv"
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--caps",
            "0.01,1",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--features",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--profile-steps",
            "1",
            "--csv",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, NCCL_DDP_NO_PROGRESS="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.DictReader(open(out)))
    assert [float(row["cap_MiB"]) for row in rows] == [0.01, 1.0]
    assert int(rows[0]["buckets"]) > int(rows[1]["buckets"]) >= 1
    for row in rows:
        assert float(row["ddp_ms"]) > 0 and 0 <= float(row["hidden_pct"]) <= 100


def test_slowest_reduces_the_backends_array_type(monkeypatch):
    """The nccl group refuses NumPy arrays: the benchmarks' timing max must go through CuPy there
    (a fake `cupy` module stands in), and stay NumPy on the host backend."""
    import types

    import numpy as np

    sys.path.insert(0, os.path.dirname(SCRIPT))
    import benchlib

    class DeviceArray(np.ndarray):
        pass

    fake = types.ModuleType("cupy")
    fake.asarray = lambda a: np.asarray(a).view(DeviceArray)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for backend, kind in (("nccl", DeviceArray), ("host", np.ndarray)):
        seen = []

        def all_reduce(t, op):
            seen.append((type(t), op))
            t[0] = 7.5

        nd = types.SimpleNamespace(
            all_reduce=all_reduce, get_world_group=lambda: types.SimpleNamespace(backend=backend)
        )
        assert benchlib.slowest(nd, 1.5) == 7.5
        assert seen == [(kind, "max")]


@pytest.mark.slow
def test_bench_ddp_torch_mode_prints_the_limit(tmp_path):
    """torch mode: our DDP beside torch's, the step's limit (the local step in lockstep + the grads
    all-reduced alone) and the timeline's phases in the same row."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.csv"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--modes", "torch", "--caps", "1", "--hidden", "32", "--layers", "2"]
        + ["--features", "8", "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--step-rounds", "2"]
        + ["--csv", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, NCCL_DDP_NO_PROGRESS="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = list(csv.DictReader(open(out)))
    num = {k: float(v) for k, v in row.items() if k.endswith(("_ms", "limit"))}
    assert num["limit_ms"] == pytest.approx(num["lockstep_ms"] + num["allreduce_ms"], rel=1e-6)
    assert num["vs_limit"] == pytest.approx(num["ddp_ms"] / num["limit_ms"], rel=1e-6)
    for k in ("torch_ddp_ms", "backward_ms", "exposed_ms", "threads_cpu_ms"):
        assert num[k] >= 0, k
    assert "vs_limit" in r.stdout and "torch_vs_limit" in r.stdout
