#!/usr/bin/env python3
"""The summary of scripts/gpu_check.sh: one table (step, status, seconds, what it showed) from
the steps' outputs, printed last, and every figure as results.json.

    python scripts/gpu_check_summary.py WORK RES

WORK holds the script's scratch files (env, steps, kernels.json, oracle.json, san_<tool>.out),
RES the files kept under $OUT (overlap.json, bench.csv, pytest.txt); results.json and
summary.txt are written to RES.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from typing import Optional

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


def read(path: str) -> Optional[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def read_json(path: str) -> Optional[dict]:
    text = read(path)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def status_of(rc: str) -> str:
    return {"0": "ok", "skipped": "skipped", "124": "TIMEOUT", "137": "TIMEOUT"}.get(rc, f"FAILED(rc {rc})")


def sanitizer(text: Optional[str], rc: str, missing: Optional[str]) -> tuple:
    """(status, detail) of one compute-sanitizer run."""
    if missing:
        return "unavailable", f"sanitizer unavailable: {missing}"
    if rc in ("124", "137"):
        return "TIMEOUT", "killed at its time limit"
    text = text or ""
    refused = re.search(
        r"^[= ]*(.*(?:Device not supported|not supported on this|Unable to "
        r"find|Target application terminated before first).*)$",
        text,
        re.MULTILINE,
    )
    if refused:  # the runtime refused the tool (gVisor): before any error count it printed
        return "unavailable", f"sanitizer unavailable: {refused.group(1).strip()[:160]}"
    race = re.search(r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors?, (\d+) warn", text)
    if race:
        n = int(race.group(2))
        return (
            "ok" if n == 0 and rc == "0" else "FAILED"
        ), f"{race.group(1)} hazards, {n} errors, {race.group(3)} warnings"
    summ = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    if summ:
        n = int(summ.group(1))
        if n == 0 and rc != "0":
            return "FAILED", f"0 errors but the driver exited {rc} (see log.txt)"
        return ("ok" if n == 0 else "FAILED"), f"{n} errors"
    lines = [ln.strip("= ").strip() for ln in text.splitlines() if ln.strip("= ").strip()]
    msg = next(
        (ln for ln in lines if re.search(r"error|not supported|unable|fail", ln, re.I)),
        lines[-1] if lines else f"no output (exit {rc})",
    )
    return "unavailable", f"sanitizer unavailable: {msg[:160]}"


def summarize(work: str, res: str) -> dict:
    env = {}
    for line in (read(os.path.join(work, "env")) or "").splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            env[k] = v
    steps = {}
    for line in (read(os.path.join(work, "steps")) or "").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            steps[parts[0]] = {"status": status_of(parts[1]), "rc": parts[1], "seconds": int(parts[2])}
    out: dict = {"env": env, "steps": steps}
    rows = []

    def row(name: str, detail: str, status: Optional[str] = None) -> None:
        st = steps.get(name, {"status": "not run", "seconds": 0})
        rows.append((name, status or st["status"], st.get("seconds", 0), detail))

    k = read_json(os.path.join(work, "kernels.json"))
    out["kernels"] = k
    if k:
        detail = (
            f"{len(k['cases'])} cases, {k['instantiations']} instantiations bit for bit, "
            f"{len(k['failed'])} failed (seed {k['seed']}), {k['canonical_nans']} canonical "
            f"NaNs"
        )
        if k["failed"]:
            detail += ": " + ", ".join(k["failed"][:3])
        if k["uncovered"]:
            detail += "; NOT COVERED: " + ", ".join(k["uncovered"])
        row("kernels", detail)
    else:
        row("kernels", "no result (see log.txt)")
    missing = read(os.path.join(work, "sanitizer_missing"))
    out["sanitizer"] = {}
    for tool in SANITIZER_TOOLS:
        name = f"san_{tool}"
        rc = steps.get(name, {}).get("rc", "")
        st, detail = sanitizer(
            read(os.path.join(work, f"{name}.out")), rc, missing.strip() if missing else None
        )
        if rc == "skipped" and not missing:
            st, detail = "skipped", "no GPU"
        out["sanitizer"][tool] = {"status": st, "detail": detail}
        row(name, detail, st)
    o = read_json(os.path.join(work, "oracle.json"))
    out["oracle"] = o
    if o:
        eq = (
            "ours == torch DDP bit for bit"
            if o.get("equal")
            else "DIFFER: " + ", ".join(o.get("differ_from_torch_ddp", [])[:4])
        )
        ms = o.get("step_ms", {})
        over = o.get("overhead_pct", {})
        row(
            "oracle",
            f"{o.get('keys')} params+buffers, {o.get('steps')} steps: {eq}; step ms "
            + " ".join(f"{m} {v:.2f}" for m, v in ms.items())
            + "; overhead vs no DDP "
            + " ".join(f"{m} {v:+.0f}%" for m, v in over.items()),
        )
    else:
        row("oracle", "no result (see log.txt)")
    row("trace", "trace.json" if os.path.exists(os.path.join(res, "trace.json")) else "no trace")
    ov = read_json(os.path.join(res, "overlap.json"))
    out["overlap"] = ov
    if ov and ov.get("summary"):
        s = max(ov["summary"], key=lambda r: r["comm_ms"])
        row(
            "overlap",
            f"hidden {s['hidden_pct']:.1f}% of {s['comm_ms']:.2f} ms comm-stream "
            f"kernels (streams {s['comm_streams']}); {s['nccl_kernels']} NCCL, "
            f"{s['pack_launches']} pack, {s['unpack_launches']} unpack launches",
        )
    else:
        row("overlap", "no result")
    bench = []
    path = os.path.join(res, "bench.csv")
    if os.path.exists(path):
        with open(path) as f:
            bench = list(csv.DictReader(f))
    out["bench"] = bench
    if bench:
        ratios = [float(r["ratio"]) for r in bench if r.get("ratio") not in (None, "", "-")]
        worst = min(bench, key=lambda r: float(r["ratio"] or 9))
        goal = sum(x >= 0.9 for x in ratios)
        row(
            "bench",
            f"{goal}/{len(ratios)} cases >= 0.90 of a D2D copy; worst "
            f"{float(worst['ratio']):.2f} ({worst['op']} {worst['pair']} {worst['MiB']} "
            f"MiB x{worst['tensors']})",
        )
    else:
        row("bench", "no result")
    p = read(os.path.join(res, "pytest.txt")) or ""
    tail = [
        ln
        for ln in p.splitlines()
        if re.search(r"\d+ (passed|failed|skipped|error|errors|deselected)|no tests ran", ln)
    ]
    row("pytest", tail[-1].strip("= ") if tail else "no result line")
    out["table"] = [dict(zip(("step", "status", "seconds", "detail"), r)) for r in rows]
    return out


def render(out: dict, res: str) -> str:
    env = out["env"]
    lines = ["=" * 100, "GPU CHECK SUMMARY"]
    if env.get("gpus", "0") == "0":
        lines.append("GPU      NONE: CuPy sees no CUDA device (GPU steps skipped)")
    else:
        lines.append(
            f"GPU      {env.get('gpu')}  ({env.get('memory_gib')} GiB, sm_{env.get('sm')}, "
            f"{env.get('sms')} SMs)  driver/runtime {env.get('driver', '?')}/"
            f"{env.get('runtime', '?')}"
        )
    lines.append(
        f"versions cupy {env.get('cupy', '?')}  nccl {env.get('nccl', '?')}  torch "
        f"{env.get('torch', '?')}  python {env.get('python', '?')}  probe "
        f"{env.get('probe', 'not run')}"
    )
    w = max([len(r["step"]) for r in out["table"]] + [4])
    lines.append(f"{'step':{w}s}  {'status':12s} {'sec':>4s}  result")
    for r in out["table"]:
        lines.append(f"{r['step']:{w}s}  {r['status']:12s} {r['seconds']:4d}  {r['detail']}")
    files = sorted(set(os.listdir(res)) | {"summary.txt"}) if os.path.isdir(res) else []
    lines.append(f"files    {res}: {', '.join(files)}")
    lines.append("=" * 100)
    return "\n".join(lines)


OK_STATUSES = ("ok", "skipped", "unavailable")


def main(argv: list) -> int:
    """Exit 0 when every step is ok, skipped or had its sanitizer refused by the runtime; else 1."""
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    work, res = argv
    out = summarize(work, res)
    with open(os.path.join(res, "results.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    text = render(out, res)
    with open(os.path.join(res, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if all(r["status"] in OK_STATUSES for r in out["table"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
