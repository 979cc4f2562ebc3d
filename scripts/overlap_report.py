#!/usr/bin/env python3
"""How much NCCL time hides behind compute, from Nsight Systems SQLite exports (one per rank) or
torch.profiler Chrome traces (CUPTI kernel records; where nsys is missing).

    python scripts/overlap_report.py prof/profile_rank0.sqlite prof/profile_rank1.sqlite [--csv out.csv]
    python scripts/overlap_report.py TRACE.json [--csv streams.csv] [--json summary.json]

A `.json` file is read as the trace `torch.profiler.profile(...).export_chrome_trace` writes:
{"traceEvents": [...]}, kernels are the events with "cat": "kernel" ("ts"/"dur" in microseconds,
`args.device`, `args.stream`). Per GPU and stream: kernel count and busy time, NCCL kernels
(name contains "nccl") and our pack/unpack launches (`nd_pack*`/`nd_unpack*`). The comm streams
are those that ran an NCCL kernel; the hidden share is the part of their kernel time (NCCL and
pack/unpack alike) that overlaps kernels running on the other streams of the same GPU, in %.

Per process and GPU: total NCCL kernel time (union of kernels whose name contains "nccl"), the part
of it that overlaps non-NCCL kernels (union of those, intersected), the ratio, and the host-side
durations of our NVTX phase ranges (backward, pack, allreduce, unpack, finalize; see
nccl_ddp/profiling/timeline.py). Make the exports with scripts/profile_nsys.sh, or
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
import json
import os
import re
import sqlite3
import sys
from collections import defaultdict
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402

from nccl_ddp.profiling import PHASES  # noqa: E402
from nccl_ddp.profiling.step_summary import overlap_length, union_length  # noqa: E402

NVTX_RANGE_TYPES = (59, 60)
COLUMNS = [
    "report",
    "rank",
    "pid",
    "device",
    "nccl_kernels",
    "nccl_ms",
    "compute_ms",
    "overlap_ms",
    "overlap_pct",
] + [f"{p}_ms" for p in PHASES]


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
        "LEFT JOIN StringIds AS s ON s.id = k.shortName"
    )
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
        f"WHERE n.eventType IN {NVTX_RANGE_TYPES} AND n.end IS NOT NULL AND n.end > n.start"
    )
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
        row = {
            "report": os.path.basename(path),
            "rank": int(m.group(1)) if m else None,
            "pid": pid,
            "device": device,
            "nccl_kernels": len(nccl),
            "nccl_ms": nccl_ns / 1e6,
            "compute_ms": union_length(other) / 1e6,
            "overlap_ms": overlap_ns / 1e6,
            "overlap_pct": 100.0 * overlap_ns / nccl_ns if nccl_ns else 0.0,
        }
        row.update({f"{p}_ms": ns / 1e6 for p, ns in nvtx[pid].items()})
        rows.append(row)
    return rows


STREAM_COLUMNS = [
    "trace",
    "device",
    "stream",
    "comm",
    "kernels",
    "busy_ms",
    "nccl_kernels",
    "nccl_ms",
    "pack",
    "unpack",
]
SUMMARY_COLUMNS = [
    "trace",
    "device",
    "comm_streams",
    "comm_ms",
    "other_ms",
    "hidden_ms",
    "hidden_pct",
    "nccl_kernels",
    "pack_launches",
    "unpack_launches",
]
PACK = re.compile(r"nd_pack")
UNPACK = re.compile(r"nd_unpack")


def read_trace(path: str) -> list:
    """(device, stream, name, start_us, end_us) of every kernel event of a Chrome trace."""
    if not os.path.isfile(path):
        raise SystemExit(f"overlap_report: no such file: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"overlap_report: {path} is not a JSON trace: {e}") from e
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") != "kernel" or ev.get("ph", "X") != "X":
            continue
        args = ev.get("args") or {}
        device = args.get("device", ev.get("pid"))
        stream = args.get("stream", ev.get("tid"))
        start = float(ev["ts"])
        out.append((device, stream, str(ev.get("name", "")), start, start + float(ev["dur"])))
    return out


def _order(x) -> tuple:
    """Sort key: numbers numerically, before anything else as text."""
    return (0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x))


def trace_report(path: str) -> tuple:
    """(per-stream rows, per-GPU summary rows) of one Chrome trace; times in ms."""
    kernels = read_trace(path)
    name = os.path.basename(path)
    per: dict = defaultdict(list)
    for device, stream, kname, start, end in kernels:
        per[(device, stream)].append((kname, start, end))
    comm = {key for key, ks in per.items() if any("nccl" in k.lower() for k, _, _ in ks)}
    streams, summary = [], []
    for device in sorted({d for d, _ in per}, key=_order):
        mine = sorted((k for k in per if k[0] == device), key=lambda k: _order(k[1]))
        comm_iv, other_iv = [], []
        for key in mine:
            ks = per[key]
            nccl = [(s, e) for k, s, e in ks if "nccl" in k.lower()]
            (comm_iv if key in comm else other_iv).extend((s, e) for _, s, e in ks)
            streams.append(
                {
                    "trace": name,
                    "device": device,
                    "stream": key[1],
                    "comm": key in comm,
                    "kernels": len(ks),
                    "busy_ms": union_length((s, e) for _, s, e in ks) / 1e3,
                    "nccl_kernels": len(nccl),
                    "nccl_ms": union_length(nccl) / 1e3,
                    "pack": sum(bool(PACK.search(k)) for k, _, _ in ks),
                    "unpack": sum(bool(UNPACK.search(k)) for k, _, _ in ks),
                }
            )
        comm_us, hidden_us = union_length(comm_iv), overlap_length(comm_iv, other_iv)
        rows = [r for r in streams if r["trace"] == name and r["device"] == device]
        summary.append(
            {
                "trace": name,
                "device": device,
                "comm_streams": " ".join(str(k[1]) for k in mine if k in comm) or "-",
                "comm_ms": comm_us / 1e3,
                "other_ms": union_length(other_iv) / 1e3,
                "hidden_ms": hidden_us / 1e3,
                "hidden_pct": 100.0 * hidden_us / comm_us if comm_us else 0.0,
                "nccl_kernels": sum(r["nccl_kernels"] for r in rows),
                "pack_launches": sum(r["pack"] for r in rows),
                "unpack_launches": sum(r["unpack"] for r in rows),
            }
        )
    return streams, summary


def trace_main(args: argparse.Namespace) -> int:
    streams, summary = [], []
    for path in args.reports:
        a, b = trace_report(path)
        streams += a
        summary += b
    if not streams:
        print(
            "no kernel events in the trace(s): was torch.profiler run with ProfilerActivity.CUDA?",
            file=sys.stderr,
        )
        return 1
    fmt = {c: ".3f" for c in STREAM_COLUMNS + SUMMARY_COLUMNS if c.endswith("_ms")}
    fmt["hidden_pct"] = ".1f"
    print(format_table(streams, STREAM_COLUMNS, fmt))
    print()
    print(format_table(summary, SUMMARY_COLUMNS, fmt))
    if args.csv:
        write_csv(streams, args.csv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"streams": streams, "summary": summary}, f, indent=1)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="nsys SQLite exports (one per rank) or torch.profiler Chrome traces (.json)",
    )
    ap.add_argument("--csv", help="also write the rows (traces: the per-stream rows) as CSV")
    ap.add_argument("--json", help="traces: also write per-stream and summary rows as JSON")
    args = ap.parse_args(argv)
    traces = [p.endswith(".json") for p in args.reports]
    if any(traces):
        if not all(traces):
            ap.error("give either SQLite exports or .json traces, not both")
        return trace_main(args)
    rows = [r for path in args.reports for r in report(path)]
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
