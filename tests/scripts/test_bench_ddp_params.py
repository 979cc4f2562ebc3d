"""scripts/bench_ddp.py --many-params runs end to end (tiny stack, worlds 1 and 2, with and without
the competing busy process) and writes one CSV row per (world, load)."""

import csv
import os
import subprocess
import sys

import pytest
from paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "bench_ddp.py")


@pytest.mark.slow
def test_many_params_smoke(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "params.csv"
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--many-params",
            "--linears",
            "3",
            "--width",
            "8",
            "--rounds",
            "2",
            "--warmup",
            "1",
            "--load",
            "--params-csv",
            str(out),
            "--params-png",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, NCCL_DDP_NO_PROGRESS="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.DictReader(open(out)))
    assert [(int(x["world"]), int(x["load"])) for x in rows] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    for x in rows:
        assert int(x["params"]) == 6
        assert float(x["local_ms"]) > 0 and float(x["ours_ms"]) > 0 and float(x["torch_ms"]) > 0
    assert "ours_us_per_param" in r.stdout and "ratio" in r.stdout
