"""scripts/bench_zero.py's table: several jobs of a mode become the median one, and each mode's
step time is compared with DDP + AdamW and with torch's ZeroRedundancyOptimizer."""

import os
import sys

from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_zero  # noqa: E402


def _row(mode: str, step_ms: float) -> dict:
    keys = ("state", "master", "reduced", "grad_buf", "total_grads", "peak_rss", "opt_growth")
    zeros = dict.fromkeys(keys, 1.0)
    return dict(zeros, world=2, mode=mode, params_M=1.0, step_ms=step_ms, hidden_pct=-1, gather_hidden_pct=-1)


def test_the_median_job_stands_for_its_mode():
    assert bench_zero.median_row([_row("zero2", t) for t in (9.0, 3.0, 5.0)])["step_ms"] == 5.0
    assert bench_zero.median_row([_row("zero2", 4.0)])["step_ms"] == 4.0


def test_each_mode_against_ddp_and_torch_zero():
    rows = bench_zero.table_rows([_row("ddp_adamw", 10.0), _row("zero2", 8.0), _row("torch_zero", 16.0)])
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["zero2"]["ratio"] == 0.8 and by_mode["zero2"]["vs_torch_zero"] == 0.5
    assert by_mode["torch_zero"]["vs_torch_zero"] == 1.0
    assert bench_zero.table_rows([_row("zero2", 8.0)])[0]["vs_torch_zero"] == ""  # no torch_zero run
