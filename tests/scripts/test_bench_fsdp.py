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


def test_rounds_keep_the_median_step_and_the_largest_memory():
    raw = [
        dict(_row("torch", t, rss), round=k)
        for k, (t, rss) in enumerate([(10.0, 100.0), (30.0, 110.0), (12.0, 90.0)])
    ]
    raw += [dict(_row("ours", 6.0, 80.0), round=k, gather_ms=4.0, exposed_gather_ms=1.0) for k in range(3)]
    rows = {r["mode"]: r for r in bench_fsdp.table_rows(raw)}
    assert rows["torch"]["step_ms"] == 12.0 and rows["torch"]["peak_rss_MiB"] == 110.0
    assert rows["torch"]["rounds"] == 3 and "round" not in rows["torch"]
    assert rows["ours"]["hidden_pct"] == 75.0  # 1 - exposed / gather


def test_side_by_side_puts_each_mode_next_to_torch_with_the_ratios():
    raw = [_row("torch", 10.0, 200.0), _row("ours", 6.0, 100.0), _row("base", 8.0, 100.0)]
    sbs = {r["mode"]: r for r in bench_fsdp.side_by_side(bench_fsdp.table_rows(raw))}
    assert set(sbs) == {"ours", "base"}
    assert sbs["ours"]["torch_step_ms"] == 10.0 and sbs["ours"]["step_ms"] == 6.0
    assert sbs["ours"]["step_ratio"] == 0.6 and sbs["base"]["step_ratio"] == 0.8
    assert sbs["ours"]["pss_ratio"] == 0.5 and sbs["ours"]["rss_ratio"] == 0.5
    assert bench_fsdp.side_by_side(bench_fsdp.table_rows([_row("ours", 6.0)])) == []  # no torch run
    text = bench_fsdp.format_table(list(sbs.values()), bench_fsdp.SIDE_BY_SIDE, bench_fsdp._sbs_formats())
    assert "0.60" in text and "step_ratio" in text
