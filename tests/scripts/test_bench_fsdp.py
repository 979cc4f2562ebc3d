"""scripts/bench_fsdp.py's table: one row per (world, mode), the largest memory and step time
over the ranks, each mode's step time against torch's fully_shard."""

import os
import sys

from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_fsdp  # noqa: E402


def _row(mode: str, step_ms: float, rss: float = 100.0) -> dict:
    return dict(
        world=2, mode=mode, params_M=1.0, step_ms=step_ms, peak_rss_MiB=rss, pss_MiB=rss, sharded_MiB=1.0
    )


def test_rows_take_the_slowest_rank_and_compare_with_torch():
    raw = [_row("torch", 10.0), _row("torch", 12.0, 90.0), _row("ours", 6.0, 120.0), _row("ours", 9.0)]
    rows = {r["mode"]: r for r in bench_fsdp.table_rows(raw)}
    assert rows["torch"]["step_ms"] == 12.0 and rows["torch"]["peak_rss_MiB"] == 100.0
    assert rows["ours"]["step_ms"] == 9.0 and rows["ours"]["vs_torch"] == 0.75
    assert rows["ours"]["peak_rss_MiB"] == 120.0
    assert bench_fsdp.table_rows([_row("ours", 9.0)])[0]["vs_torch"] == ""  # no torch run
