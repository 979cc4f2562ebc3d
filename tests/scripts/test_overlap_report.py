"""scripts/overlap_report.py against small SQLite files in nsys's export schema with known intervals."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import sqlite3
import subprocess
import sys

import pytest
from paths import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(ROOT, "scripts", "overlap_report.py")
MS = 1_000_000  # ns


@pytest.fixture(scope="module")
def orep():
    spec = importlib.util.spec_from_file_location("overlap_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
    shortName INTEGER NOT NULL, mangledName INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER, domainId INTEGER);
"""


def gpid(pid):
    return (7 << 48) | (pid << 24)  # serialized: high bits (host/vm ids), then the pid


class Report:
    def __init__(self, path):
        self.conn = sqlite3.connect(path)
        self.conn.executescript(SCHEMA)
        self.names: dict = {}

    def sid(self, value):
        if value not in self.names:
            self.names[value] = len(self.names) + 1
            self.conn.execute("INSERT INTO StringIds VALUES (?, ?)", (self.names[value], value))
        return self.names[value]

    def kernel(self, pid, device, start, end, short, demangled=None, stream=7):
        d = self.sid(demangled) if demangled else 999_999  # dangling id: shortName is used
        self.conn.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?,?)",
            (start * MS, end * MS, device, 1, stream, 0, gpid(pid), d, self.sid(short), None),
        )

    def nvtx(self, pid, start, end, text, registered=False, event_type=59):
        text_id = self.sid(text) if registered else None
        self.conn.execute(
            "INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                start * MS,
                None if end is None else end * MS,
                event_type,
                None,
                None,
                None,
                None if registered else text,
                gpid(pid) | 12345,
                None,
                text_id,
                0,
            ),
        )

    def close(self):
        self.conn.commit()
        self.conn.close()


@pytest.fixture
def reports(tmp_path):
    r0 = Report(str(tmp_path / "profile_rank0.sqlite"))
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    # compute: [0,100] + [50,150] overlap -> [0,150]; [300,400] + [400,450] adjacent -> [300,450]
    r0.kernel(100, 0, 0, 100, "sgemm_128x64", "void sgemm_128x64<float>(float*)")
    r0.kernel(100, 0, 50, 150, "pack_bucket_f32")
    r0.kernel(100, 0, 300, 400, "elementwise")
    r0.kernel(100, 0, 400, 450, "elementwise")
    # nccl: [100,200] with [140,160] nested and [200,300] adjacent -> [100,300];
    #       [450,500] only touches compute; [600,700] disjoint
    r0.kernel(100, 0, 100, 200, nccl, nccl + "(ncclDevKernelArgsStorage<4096>)", stream=9)
    r0.kernel(100, 0, 140, 160, "ncclDevKernel_Broadcast_RING_LL", stream=10)
    r0.kernel(100, 0, 200, 300, nccl, stream=9)
    r0.kernel(100, 0, 450, 500, nccl, stream=9)
    r0.kernel(100, 0, 600, 700, nccl, stream=9)
    r0.nvtx(100, 0, 400, "backward")
    r0.nvtx(100, 90, 100, "pack bucket 0 4.00 MiB", registered=True)
    r0.nvtx(100, 100, 300, "allreduce bucket 0 4.00 MiB", registered=True)
    r0.nvtx(100, 450, 500, "allreduce bucket 1 1.00 MiB")
    r0.nvtx(100, 700, 720, "finalize", event_type=60)  # start/end range
    r0.nvtx(100, 10, None, "backward", event_type=34)  # a mark: no end, ignored
    r0.nvtx(100, 0, 1000, "forward")  # not one of our phases
    r0.close()
    r1 = Report(str(tmp_path / "profile_rank1.sqlite"))
    r1.kernel(200, 1, 0, 20, "conv2d_fprop")
    r1.kernel(200, 1, 5, 15, "ncclDevKernel_AllGather_RING_LL")
    r1.nvtx(200, 0, 30, "backward")
    r1.close()
    return tmp_path / "profile_rank0.sqlite", tmp_path / "profile_rank1.sqlite"


def test_overlap_numbers_exact(orep, reports):
    (row0,) = orep.report(str(reports[0]))
    assert (row0["rank"], row0["pid"], row0["device"], row0["nccl_kernels"]) == (0, 100, 0, 5)
    assert row0["nccl_ms"] == 350.0  # [100,300] + [450,500] + [600,700]
    assert row0["compute_ms"] == 300.0  # [0,150] + [300,450]
    assert row0["overlap_ms"] == 50.0  # [100,150]; [450,500] only touches [300,450]
    assert row0["overlap_pct"] == 100.0 * 50 / 350
    assert (
        row0["backward_ms"],
        row0["pack_ms"],
        row0["allreduce_ms"],
        row0["unpack_ms"],
        row0["finalize_ms"],
    ) == (400.0, 10.0, 250.0, 0.0, 20.0)
    (row1,) = orep.report(str(reports[1]))
    assert (row1["rank"], row1["pid"], row1["device"]) == (1, 200, 1)
    assert (row1["nccl_ms"], row1["overlap_ms"], row1["overlap_pct"]) == (10.0, 10.0, 100.0)
    assert row1["backward_ms"] == 30.0 and row1["allreduce_ms"] == 0.0


def test_main_prints_table_and_writes_csv(orep, reports, tmp_path, capsys):
    out_csv = tmp_path / "overlap.csv"
    assert orep.main([str(reports[0]), str(reports[1]), "--csv", str(out_csv)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split() == orep.COLUMNS
    assert text[1].split()[:9] == [
        "profile_rank0.sqlite",
        "0",
        "100",
        "0",
        "5",
        "350.000",
        "300.000",
        "50.000",
        "14.3",
    ]
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["rank"] for r in rows] == ["0", "1"] and float(rows[1]["overlap_pct"]) == 100.0


def test_report_without_kernels(orep, tmp_path, capsys):
    path = tmp_path / "empty.sqlite"
    with contextlib.closing(sqlite3.connect(str(path))) as db:
        db.executescript("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);")
    assert orep.report(str(path)) == []
    assert orep.main([str(path)]) == 1
    assert "no CUDA kernels" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- profile_nsys.sh

PROFILE_SH = os.path.join(ROOT, "scripts", "profile_nsys.sh")

FAKE_NSYS = r'''#!PYTHON
"""Stands in for nsys: `profile` writes a tiny report for this process and runs the command;
`export` copies the report (already SQLite) to the output path."""
import os, re, shutil, sqlite3, subprocess, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
if args[0] == "export":
    shutil.copy(args[-1], out)
    sys.exit(0)
out = re.sub(r"%q\{(\w+)\}", lambda m: os.environ.get(m.group(1), ""), out) + ".nsys-rep"
cmd = args[args.index("-o") + 2:]
db = sqlite3.connect(out)
db.executescript(SCHEMA)
db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "ncclDevKernel_AllReduce"), (2, "gemm")])
pid = (os.getpid() << 24)
db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,0,1,7,0,?,?,?,NULL)",
               [(0, 4_000_000, pid, 1, 1), (0, 1_000_000, pid, 2, 2)])
db.commit()
db.close()
sys.exit(subprocess.call(cmd))
'''


def _fake_nsys(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(FAKE_NSYS.replace("PYTHON", sys.executable).replace("SCHEMA", repr(SCHEMA)))
    nsys.chmod(0o755)
    return str(bin_dir)


def test_profile_script_syntax_and_missing_nsys(tmp_path):
    subprocess.run(["bash", "-n", PROFILE_SH], check=True, timeout=30)
    r = subprocess.run(
        ["bash", PROFILE_SH, "train.py"],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PATH="/usr/bin:/bin"),
    )
    assert r.returncode == 2 and "nsys (Nsight Systems CLI) is not on PATH" in r.stderr


def test_profile_script_end_to_end_with_fake_nsys(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('nvtx', os.environ['NCCL_DDP_NVTX'], 'rank', os.environ['RANK'])\n")
    out = tmp_path / "prof"
    env = dict(os.environ, PATH=_fake_nsys(tmp_path) + os.pathsep + os.environ["PATH"], PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", PROFILE_SH, "-o", str(out), "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "nvtx 1 rank 0" in r.stdout and "nvtx 1 rank 1" in r.stdout
    assert sorted(p.name for p in out.glob("*.sqlite")) == ["profile_rank0.sqlite", "profile_rank1.sqlite"]
    rows = list(csv.DictReader((out / "overlap.csv").open()))
    assert [r["rank"] for r in rows] == ["0", "1"]
    assert all(float(r["nccl_ms"]) == 4.0 and float(r["overlap_pct"]) == 25.0 for r in rows)


# ---------------------------------------------------------------------------------- Chrome traces


def _kernel(name, start, end, stream, device=0):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": device,
        "tid": stream,
        "ts": float(start),
        "dur": float(end - start),
        "args": {"device": device, "stream": stream, "correlation": 1},
    }


@pytest.fixture
def trace(tmp_path):
    """A torch.profiler export_chrome_trace file with known intervals (us)."""
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = [
        _kernel("void at::native::conv2d_fprop(float*)", 0, 100, 7),
        _kernel("void at::native::elementwise(float*)", 150, 250, 7),
        # comm stream 13: pack, NCCL, unpack twice -> [80,140] + [240,305] = 125 us,
        # of which [80,100] and [240,250] run beside stream 7's kernels: 30 us hidden
        _kernel("void nd_pack<float, float, false>(Seg const*, int, float*, int, double, int*)", 80, 90, 13),
        _kernel(nccl, 90, 130, 13),
        _kernel("void nd_unpack<float, float, false>(Seg const*, int, float*, int, double)", 130, 140, 13),
        _kernel("_Z13nd_pack_smallIffLb1EEv10SmallTablePfid", 240, 245, 13),
        _kernel(nccl, 245, 300, 13),
        _kernel("_Z15nd_unpack_smallIffLb0EEv10SmallTablePKfid", 300, 305, 13),
        _kernel("void at::native::reduce(float*)", 0, 10, 7, device=1),
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD",
            "pid": 0,
            "tid": 7,
            "ts": 100.0,
            "dur": 200.0,
            "args": {"device": 0, "stream": 7},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::add_",
            "pid": 1234,
            "tid": 1,
            "ts": 0.0,
            "dur": 1000.0,
            "args": {},
        },
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_trace_streams_and_hidden_share_exact(orep, trace):
    streams, summary = orep.trace_report(str(trace))
    s7, s13, d1 = streams
    assert (s7["device"], s7["stream"], s7["comm"], s7["kernels"], s7["busy_ms"]) == (0, 7, False, 2, 0.2)
    assert (s13["stream"], s13["comm"], s13["kernels"], s13["nccl_kernels"], s13["pack"], s13["unpack"]) == (
        13,
        True,
        6,
        2,
        2,
        2,
    )
    assert s13["busy_ms"] == pytest.approx(0.125) and s13["nccl_ms"] == pytest.approx(0.095)
    assert (d1["device"], d1["comm"], d1["kernels"]) == (1, False, 1)
    g0, g1 = summary
    assert g0["comm_streams"] == "13" and g0["comm_ms"] == pytest.approx(0.125)
    assert g0["hidden_ms"] == pytest.approx(0.030)
    assert g0["hidden_pct"] == pytest.approx(24.0)
    assert (g0["nccl_kernels"], g0["pack_launches"], g0["unpack_launches"]) == (2, 2, 2)
    assert (g1["comm_ms"], g1["hidden_pct"], g1["comm_streams"]) == (0.0, 0.0, "-")


def test_trace_main_prints_tables_and_writes_csv_json(orep, trace, tmp_path, capsys):
    out_csv, out_json = tmp_path / "streams.csv", tmp_path / "overlap.json"
    assert orep.main([str(trace), "--csv", str(out_csv), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == orep.STREAM_COLUMNS
    assert " 24.0 " in text
    assert [r["stream"] for r in csv.DictReader(out_csv.open())] == ["7", "13", "7"]
    summary = json.loads(out_json.read_text())["summary"]
    assert summary[0]["hidden_pct"] == pytest.approx(24.0)


def test_trace_without_kernels_and_mixed_inputs(orep, tmp_path, reports, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
    )
    assert orep.main([str(empty)]) == 1
    assert "no kernel events" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        orep.main([str(empty), str(reports[0])])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="not a JSON trace"):
        orep.main([str(bad)])
