"""scripts/gpu_check.sh's own logic without a GPU: --help and --budget, the worst-case arithmetic,
every step's failure reported while the others run (a scratch copy of the repo with a fake CuPy
reporting an H200, a fake compute-sanitizer and fake step scripts), the summary's parsing, and
the GPU kernel cases (scripts/gpu_kernel_cases.py) run on the CPU build of the kernels, which is
how a case failing on the GPU replays here."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_summary as summary  # noqa: E402
import gpu_kernel_cases as gkc  # noqa: E402

FAKE_CUPY = """
__version__ = "14.2.0"
from . import cuda

class RawKernel:   # the probe's compile fails the way a missing CUDA toolkit header does
    def __init__(self, code, name):
        raise RuntimeError("CompileException: kern.cu(1): catastrophic error: cannot open "
                           "source file \\"cuda_fp16.h\\"")
"""
FAKE_CUDA = """
import types
from . import nccl
is_available = lambda: True
runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1, driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13000,
    getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "totalGlobalMem": 141 << 30,
                                   "major": 9, "minor": 0, "multiProcessorCount": 132})
"""
FAKE_NCCL = "available = True\nget_version = lambda: 22805\n"
FAKE_CASES = """
import json, sys
args = sys.argv[1:]
if "--once" in args:        # the sanitizer driver
    print("driver ran")
    sys.exit(0)
json.dump({"seed": 7, "cases": [{"name": "nd_scale<float>", "mismatches": 0}] * 3,
           "instantiations": 52, "failed": ["nd_pack<float, float, true>"], "errors": [],
           "uncovered": ["optim.cu"], "canonical_nans": 4},
          open(args[args.index("--json") + 1], "w"))
print("MISMATCH nd_pack<float, float, true> seed=7: planted")
sys.exit(1)
"""
FAKE_SANITIZER = """#!/usr/bin/env bash
case "$2" in
  memcheck) "${@:6}"; echo "========= ERROR SUMMARY: 0 errors" ;;
  racecheck) echo "========= Error: Target application terminated before first API call"
             exit 1 ;;
  synccheck) sleep 60 ;;
esac
"""
FAKE_ORACLE = """
import json, sys
a = sys.argv[1:]
json.dump({"keys": 18, "steps": 20, "equal": True, "differ_from_torch_ddp": [],
           "step_ms": {"plain": 2.0, "torch_ddp": 2.2, "ours": 2.1},
           "overhead_pct": {"torch_ddp": 10.0, "ours": 5.0}}, open(a[a.index("--json") + 1], "w"))
open(a[a.index("--csv") + 1], "w").write("mode,step_ms\\nours,2.1\\n")
"""
FAKE_TRACE = """
import json, sys
def k(name, s, e, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": s, "dur": e - s,
            "args": {"device": 0, "stream": stream}}
ev = [k("conv", 0, 100, 7), k("conv", 150, 250, 7), k("nd_pack<f>", 80, 90, 13),
      k("ncclDevKernel_AllReduce", 90, 130, 13), k("nd_unpack<f>", 130, 140, 13),
      k("nd_pack_small<f>", 240, 245, 13), k("ncclDevKernel_AllReduce", 245, 300, 13),
      k("nd_unpack_small<f>", 300, 305, 13)]
json.dump({"traceEvents": ev}, open(sys.argv[sys.argv.index("--out") + 1], "w"))
"""
FAKE_BENCH = """
import csv, sys
out = sys.argv[sys.argv.index("--csv") + 1]
rows = [dict(op=op, pair="f32", MiB=m, tensors=n, ratio="0.95" if (m, n) != ("1", "1000") else "0.62")
        for op in ("pack",) for m in ("1", "25", "100") for n in ("10", "100", "1000")]
w = csv.DictWriter(open(out, "w"), fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)
"""
FAKE_TESTS = """
import pytest

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "planted"

def test_not_gpu():
    pass
"""


def _run(cwd, env, *args, timeout=240):
    return subprocess.run(
        ["bash", str(cwd / "scripts" / "gpu_check.sh"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def scratch(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "tests").mkdir()
    for name in (
        "gpu_check.sh",
        "gpu_check_summary.py",
        "pytest_gpu_first.py",
        "overlap_report.py",
        "benchlib.py",
    ):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "nccl_ddp").symlink_to(ROOT / "nccl_ddp")  # the real launcher and profiling
    for name, text in (
        ("gpu_kernel_cases.py", FAKE_CASES),
        ("gpu_torch_oracle.py", FAKE_ORACLE),
        ("gpu_trace.py", FAKE_TRACE),
        ("bench_kernels.py", FAKE_BENCH),
    ):
        (repo / "scripts" / name).write_text(text)
    (repo / "tests" / "test_fake.py").write_text(FAKE_TESTS)
    (repo / "setup.cfg").write_text("[tool:pytest]\nmarkers =\n    gpu: needs a GPU\n")
    fake = tmp_path / "fake" / "cupy" / "cuda"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text(FAKE_CUPY)
    (fake / "__init__.py").write_text(FAKE_CUDA)
    (fake / "nccl.py").write_text(FAKE_NCCL)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (bindir / "compute-sanitizer").chmod(0o755)
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        PYTHONPATH=str(tmp_path / "fake"),
        OUT=str(tmp_path / "out"),
        PATH=f"{bindir}:{os.environ['PATH']}",
        GPU_CHECK_SANITIZER_TIMEOUT="3",
        GPU_CHECK_GRACE="1",
    )
    return repo, env, tmp_path / "out"


def test_help_prints_usage_and_starts_nothing(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", str(SCRIPT), flag], env=env, capture_output=True, text=True, timeout=30)
        assert (
            r.returncode == 0
            and "Usage: bash scripts/gpu_check.sh [--help | --budget]" in r.stdout
            and "sanitizer unavailable: <message>" in r.stdout
        )
    assert not (tmp_path / "out").exists()
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 64 and "unknown argument '--bogus'" in r.stderr


def test_worst_case_with_graces_is_under_400_s(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--budget"],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    steps = re.findall(r"^(\S+)\s+(\d+) s \+ (\d+) s grace$", r.stdout, re.MULTILINE)
    assert {s for s, _, _ in steps} >= {
        "env",
        "kernels",
        "san_memcheck",
        "san_racecheck",
        "san_synccheck",
        "oracle",
        "trace",
        "overlap",
        "bench",
        "pytest",
        "summary",
    }
    total = int(re.search(r"worst case\s+(\d+) s \(budget 400 s\)", r.stdout).group(1))
    assert total == sum(int(a) + int(b) for _, a, b in steps) and total < 400


def test_over_budget_refuses_before_running_anything(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_ORACLE_TIMEOUT="100")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "433s worst case" in r.stderr and "over the 400s budget" in r.stderr
    assert not (tmp_path / "out").exists()
    r = subprocess.run(["bash", str(SCRIPT), "--budget"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "worst case      433 s" in r.stdout


@pytest.mark.slow
def test_every_step_reported_and_none_stops_the_others(scratch):
    repo, env, out = scratch
    res = _run(repo, env)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "GPU CHECK SUMMARY")
    text = "\n".join(lines[start:])
    assert lines[-1].startswith("=====") and len(lines) - start < 25
    assert "NVIDIA H200  (141 GiB, sm_90, 132 SMs)  driver/runtime 13000/13000" in text
    assert "probe FAILED RuntimeError: CompileException" in text

    def row(step):
        return next(ln for ln in lines[start:] if ln.startswith(step + " "))

    assert (
        "FAILED(rc 1)" in row("kernels")
        and "1 failed (seed 7)" in row("kernels")
        and "NOT COVERED: optim.cu" in row("kernels")
    )
    assert " ok " in row("san_memcheck") and "0 errors" in row("san_memcheck")
    assert "unavailable" in row(
        "san_racecheck"
    ) and "sanitizer unavailable: Error: Target application terminated" in row("san_racecheck")
    assert "TIMEOUT" in row("san_synccheck")
    assert (
        " ok " in row("oracle")
        and "ours == torch DDP bit for bit" in row("oracle")
        and "ours +5%" in row("oracle")
    )
    assert " ok " in row("trace")
    assert "hidden 24.0% of 0.12 ms" in row("overlap") and "2 NCCL, 2 pack, 2 unpack" in row("overlap")
    assert "8/9 cases >= 0.90 of a D2D copy; worst 0.62 (pack f32 1 MiB x1000)" in row("bench")
    assert "FAILED(rc 1)" in row("pytest") and "1 failed, 1 passed, 1 deselected" in row("pytest")
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "bench.csv",
        "log.txt",
        "oracle.csv",
        "overlap.json",
        "pytest.txt",
        "results.json",
        "summary.txt",
        "trace.json",
    ]
    assert all(p.is_file() for p in out.iterdir())
    results = json.loads((out / "results.json").read_text())
    assert results["sanitizer"]["synccheck"]["status"] == "TIMEOUT"
    assert results["oracle"]["equal"] is True and results["overlap"]["summary"][0][
        "hidden_pct"
    ] == pytest.approx(24.0)
    assert text.strip() in (out / "summary.txt").read_text()
    assert "planted" in (out / "log.txt").read_text()


@pytest.mark.slow
def test_without_a_gpu_it_says_so(scratch):
    repo, env, out = scratch
    (repo / "tests" / "test_fake.py").write_text(FAKE_TESTS.replace("assert 1 == 2", "pass #"))
    env["PYTHONPATH"] = ""  # the real CuPy (if any) sees no GPU on this machine
    res = _run(repo, env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "NO GPU: CuPy sees no CUDA device" in res.stdout and "GPU      NONE" in res.stdout
    assert re.search(r"^kernels\s+skipped", res.stdout, re.MULTILINE)
    assert "2 passed, 1 deselected" in res.stdout  # the gpu marker still selects the tests


@pytest.mark.parametrize(
    "text, rc, missing, want",
    [
        (
            "========= COMPUTE-SANITIZER\nkernel cases: ...\n========= ERROR SUMMARY: 0 errors\n",
            "0",
            None,
            ("ok", "0 errors"),
        ),
        (
            "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n",
            "86",
            None,
            ("FAILED", "3 errors"),
        ),
        (
            "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warnings)\n",
            "86",
            None,
            ("FAILED", "2 hazards, 1 errors, 1 warnings"),
        ),
        (
            "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
            "0",
            None,
            ("ok", "0 hazards, 0 errors, 0 warnings"),
        ),
        (
            "========= Error: Device not supported. Please refer to the documentation\n",
            "1",
            None,
            (
                "unavailable",
                "sanitizer unavailable: Error: Device not supported. Please refer to the documentation",
            ),
        ),
        (
            "========= Error: Device not supported\n========= Program hit cudaErrorUnknown (error 999)"
            "\n========= ERROR SUMMARY: 1 error\n",
            "86",
            None,
            ("unavailable", "sanitizer unavailable: Error: Device not supported"),
        ),
        (
            "",
            "",
            "compute-sanitizer not found on PATH",
            ("unavailable", "sanitizer unavailable: compute-sanitizer not found on PATH"),
        ),
        ("partial", "124", None, ("TIMEOUT", "killed at its time limit")),
    ],
)
def test_sanitizer_outputs(text, rc, missing, want):
    assert summary.sanitizer(text, rc, missing) == want


def test_verdict_a_refused_sanitizer_is_not_a_failure(tmp_path, capsys):
    work, res = tmp_path / "work", tmp_path / "res"
    work.mkdir()
    res.mkdir()
    (work / "env").write_text("gpus=1\ngpu=NVIDIA H200\n")
    names = [
        "kernels",
        "san_memcheck",
        "san_racecheck",
        "san_synccheck",
        "oracle",
        "trace",
        "overlap",
        "bench",
        "pytest",
    ]
    (work / "steps").write_text("".join(f"{n} {86 if n.startswith('san') else 0} 1\n" for n in names))
    for t in ("memcheck", "racecheck", "synccheck"):
        (work / f"san_{t}.out").write_text(
            "========= Error: Device not supported\n========= ERROR SUMMARY: 1 error\n"
        )
    assert summary.main([str(work), str(res)]) == 0
    assert "sanitizer unavailable: Error: Device not supported" in capsys.readouterr().out
    (work / "steps").write_text((work / "steps").read_text().replace("oracle 0", "oracle 1"))
    assert summary.main([str(work), str(res)]) == 1
    assert json.loads((res / "results.json").read_text())["steps"]["oracle"]["status"] == "FAILED(rc 1)"


# ---------------------------------------------------------------------------------- kernel cases


def test_comparison_policy():
    import kernel_cases as kc

    f = np.array([1.0, -0.0, np.nan, 2.0], np.float32)
    assert kc.compare_bytes(f.copy(), f)["mismatches"] == 0
    g = f.copy()
    g[1] = 0.0  # +0.0 where -0.0 is due
    assert kc.compare_bytes(g, f)["mismatches"] == 1
    want = f.copy()
    want.view(np.uint32)[2] = 0x7FC0_0001  # a NaN with a payload
    canon = want.copy()
    canon.view(np.uint32)[2] = 0x7FFF_FFFF  # the GPU's canonical NaN: accepted
    assert kc.compare_bytes(canon, want) == {"mismatches": 0, "canonical_nans": 1, "first": ""}
    other = want.copy()
    other.view(np.uint32)[2] = 0x7FC0_0002  # another payload: not
    assert kc.compare_bytes(other, want)["mismatches"] == 1
    nan_for_number = f.copy()
    nan_for_number[0] = np.nan
    assert kc.compare_bytes(nan_for_number, f)["mismatches"] == 1
    h = np.array([0.5, np.nan], np.float16)
    hc = h.copy()
    hc.view(np.uint16)[1] = 0x7FFF
    assert kc.compare_bytes(hc, h)["canonical_nans"] == (h.view(np.uint16)[1] != 0x7FFF)


@pytest.fixture
def fake_cp(monkeypatch):
    import _fake_cupy
    from _fake_cupy import FakeCupy

    from nccl_ddp.kernels import cuda as ck

    def make(cpu):
        if cpu and _fake_cupy.cpu_kernels() is None:
            pytest.skip(_fake_cupy.CPU_KERNELS_MISSING)
        fake = FakeCupy(cpu=cpu)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
        return fake

    return make


@pytest.mark.slow
def test_gpu_kernel_cases_replay_on_the_cpu(fake_cp):
    """Every instantiation once (the sanitizer driver's run) on the CPU build of bucket.cu;
    NCCL_DDP_CASE / NCCL_DDP_CASE_SEED replay one case a GPU run reported, in full."""
    only = os.environ.get("NCCL_DDP_CASE")
    seed = int(os.environ.get("NCCL_DDP_CASE_SEED", "20261201"))
    from nccl_ddp.kernels import cuda as ck

    res = gkc.run(fake_cp(cpu=True), seed, once=only is None, only=only)
    assert not res["errors"], res["errors"]
    assert res["failed"] == [], [c for c in res["cases"] if c["mismatches"]]
    assert res["instantiations"] == (1 if only else len(ck.name_expressions()))
    assert "bucket.cu" not in res["uncovered"]


@pytest.mark.slow
def test_gpu_kernel_cases_report_a_wrong_kernel(fake_cp, monkeypatch):
    """A reference that disagrees by one ulp in scale (a stand-in for a wrong kernel) fails the
    scale instantiations and only them, with the seed to replay."""
    import kernel_cases as kc

    fake_cp(cpu=False)
    real = kc.K

    def off_by_one_ulp(buf, factor):
        real.scale_ref(buf, factor)
        if buf.size:
            u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[buf.dtype.itemsize]
            buf.reshape(-1).view(u)[0] ^= u(1)

    class Proxy:  # the cases' references only (the fake GPU runs the real ones)
        def __getattr__(self, name):
            return off_by_one_ulp if name == "scale_ref" else getattr(real, name)

    monkeypatch.setattr(kc, "K", Proxy())
    res = gkc.run(sys.modules["cupy"], 5, once=True)
    assert res["failed"] == sorted(c[0] for c in kc.plan() if c[1] == "scale")
    bad = [c for c in res["cases"] if c["mismatches"]]
    assert all(c["seed"] == 5 and "at [0]" in c["first"] for c in bad)


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_gpu_tests_that_matter_most_run_first():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import pytest_gpu_first as plugin
    finally:
        sys.path.pop(0)

    class Item:
        def __init__(self, file, name):
            self.path, self.name = Path("tests") / file, name

    items = [
        Item("test_api.py", "test_a"),
        Item("test_nccl_backend.py", "test_n"),
        Item("test_kernels_gpu.py", "test_pack"),
        Item("test_torch_adapter.py", "test_t"),
        Item("test_kernels_gpu.py", "test_bf16_x"),
        Item("test_ddp_gpu.py", "test_d"),
    ]
    plugin.pytest_collection_modifyitems(None, None, items)
    assert [(i.path.name, i.name) for i in items] == [
        ("test_kernels_gpu.py", "test_bf16_x"),
        ("test_kernels_gpu.py", "test_pack"),
        ("test_torch_adapter.py", "test_t"),
        ("test_ddp_gpu.py", "test_d"),
        ("test_nccl_backend.py", "test_n"),
        ("test_api.py", "test_a"),
    ]


@pytest.mark.slow
def test_oracle_and_trace_scripts_run_on_the_cpu(tmp_path):
    """The oracle and trace steps' scripts, in their --cpu form under the launcher: torch DDP
    (gloo) and ours (host backend) end bit for bit equal; the trace is written and read."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_DDP_NO_PROGRESS="1")
    run = [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "1"]
    r = subprocess.run(
        run
        + [
            str(ROOT / "scripts" / "gpu_torch_oracle.py"),
            "--cpu",
            "--steps",
            "2",
            "--time-steps",
            "2",
            "--json",
            str(tmp_path / "o.json"),
            "--csv",
            str(tmp_path / "o.csv"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    o = json.loads((tmp_path / "o.json").read_text())
    assert o["equal"] and o["keys"] == 18 and set(o["step_ms"]) == {"plain", "torch_ddp", "ours"}
    r = subprocess.run(
        run
        + [
            str(ROOT / "scripts" / "gpu_trace.py"),
            "--cpu",
            "--out",
            str(tmp_path / "t.json"),
            "--steps",
            "1",
            "--warmup",
            "1",
            "--width",
            "32",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "traceEvents" in json.loads((tmp_path / "t.json").read_text())
