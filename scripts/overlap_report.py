#!/usr/bin/env python3
"""How much NCCL time hides behind compute, from Nsight Systems SQLite exports (one per rank).

    python scripts/overlap_report.py prof/profile_rank0.sqlite prof/profile_rank1.sqlite [--csv out.csv]

Per process and GPU: total NCCL kernel time (union of kernels whose name contains "nccl"), the part
of it that overlaps non-NCCL kernels (union of those, intersected), the ratio, and the host-side
durations of our NVTX phase ranges (backward, pack, allreduce, unpack, finalize; see
nccl_ddp/profiling.py). Make the exports with scripts/profile_nsys.sh, or
`nsys export --type sqlite -o X.sqlite X.nsys-rep`.

Schema used (Nsight Systems "SQLite Export Schema Reference",
https://docs.nvidia.com/nsight-systems/2021.5/nsys-exporter/exported_data.html; tables are created
lazily, so a report without kernels or NVTX lacks the table):
  CUPTI_ACTIVITY_KIND_KERNEL(start, end [ns], deviceId, streamId, globalPid,
                             demangledName, shortName -> StringIds.id)
  StringIds(id, value)
  NVTX_EVENTS(start, end [ns], eventType, text, textId -> StringIds.id, globalTid)
      eventType 59 = push/pop range, 60 = start/end range; `text` is NULL when the string was
      registered (then `textId` names it).
  globalPid / globalTid are serialized ids: the OS pid is (id >> 24) & 0xFFFFFF.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sqlite3
import sys
from collections import defaultdict
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402

from nccl_ddp.profiling import PHASES, overlap_length, union_length  # noqa: E402

NVTX_RANGE_TYPES = (59, 60)
COLUMNS = (["report", "rank", "pid", "device", "nccl_kernels", "nccl_ms", "compute_ms",
            "overlap_ms", "overlap_pct"] + [f"{p}_ms" for p in PHASES])


def _pid(global_id: Optional[int]) -> int:
    return ((global_id or 0) >> 24) & 0xFFFFFF


def _tables(conn: sqlite3.Connection) -> set:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def read_kernels(conn: sqlite3.Connection) -> dict:
    """(pid, device) -> ([nccl intervals], [other kernel intervals]) in ns."""
    out: dict = defaultdict(lambda: ([], []))
    if "CUPTI_ACTIVITY_KIND_KERNEL" not in _tables(conn):
        return out
    rows = conn.execute(
        "SELECT k.start, k.end, k.deviceId, k.globalPid, COALESCE(d.value, s.value, '') "
        "FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
        "LEFT JOIN StringIds AS d ON d.id = k.demangledName "
        "LEFT JOIN StringIds AS s ON s.id = k.shortName")
    for start, end, device, gpid, name in rows:
        nccl, other = out[(_pid(gpid), device)]
        (nccl if "nccl" in name.lower() else other).append((start, end))
    return out


def read_nvtx(conn: sqlite3.Connection) -> dict:
    """pid -> {phase: summed ns} over our phase ranges (the label's first word names the phase)."""
    out: dict = defaultdict(lambda: dict.fromkeys(PHASES, 0))
    if "NVTX_EVENTS" not in _tables(conn):
        return out
    rows = conn.execute(
        "SELECT n.start, n.end, COALESCE(n.text, s.value, ''), n.globalTid FROM NVTX_EVENTS AS n "
        "LEFT JOIN StringIds AS s ON s.id = n.textId "
        f"WHERE n.eventType IN {NVTX_RANGE_TYPES} AND n.end IS NOT NULL AND n.end > n.start")
    for start, end, text, gtid in rows:
        phase = text.split(" ", 1)[0].lower()
        if phase in PHASES:
            out[_pid(gtid)][phase] += end - start
    return out


def report(path: str) -> list:
    """One row per (process, GPU) of one SQLite export; times in ms."""
    if not os.path.isfile(path):
        raise SystemExit(f"overlap_report: no such file: {path}")
    m = re.search(r"rank[_-]?(\d+)", os.path.basename(path))
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        kernels, nvtx = read_kernels(conn), read_nvtx(conn)
    rows = []
    for (pid, device), (nccl, other) in sorted(kernels.items()):
        nccl_ns = union_length(nccl)
        overlap_ns = overlap_length(nccl, other)
        row = {"report": os.path.basename(path), "rank": int(m.group(1)) if m else None,
               "pid": pid, "device": device, "nccl_kernels": len(nccl), "nccl_ms": nccl_ns / 1e6,
               "compute_ms": union_length(other) / 1e6, "overlap_ms": overlap_ns / 1e6,
               "overlap_pct": 100.0 * overlap_ns / nccl_ns if nccl_ns else 0.0}
        row.update({f"{p}_ms": ns / 1e6 for p, ns in nvtx[pid].items()})
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sqlite", nargs="+", help="nsys SQLite exports, one per rank")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    rows = [r for path in args.sqlite for r in report(path)]
    if not rows:
        print("no CUDA kernels found in the report(s): was nsys run with -t cuda?", file=sys.stderr)
        return 1
    fmt = {c: ".3f" for c in COLUMNS if c.endswith("_ms")}
    fmt["overlap_pct"] = ".1f"
    print(format_table(rows, COLUMNS, fmt))
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
