"""scripts/gpu_check.sh's logic, here without a GPU: in a scratch copy of the repo with a fake
CuPy that reports an H200, fake benchmark scripts (one of them hangs) and two gpu tests (one
fails); and for real on this machine, where it must say clearly that there is no GPU."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

FAKE_CUPY = '''
__version__ = "14.2.0"
from . import cuda

class RawKernel:   # the probe's compile fails the way a missing CUDA toolkit header does
    def __init__(self, code, name):
        raise RuntimeError("CompileException: kern.cu(1): catastrophic error: cannot open "
                           "source file \\"cuda_fp16.h\\"")
'''
FAKE_CUDA = '''
import types
from . import nccl
is_available = lambda: True
runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1, driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13000,
    getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "totalGlobalMem": 141 << 30,
                                   "major": 9, "minor": 0, "multiProcessorCount": 132})
'''
FAKE_NCCL = "available = True\nget_version = lambda: 22805\n"
FAKE_BENCH = '''
import csv, sys
args = sys.argv[1:]
out = args[args.index("--csv") + 1]
chunks = args[args.index("--chunk-bytes") + 1].split(",") if "--chunk-bytes" in args else ["8192"]
rows = []
for chunk in chunks:
    for op in ("pack", "unpack"):
        for pair in ("f32", "f32-bf16"):
            for mib in ("1", "25", "100"):
                for n in ("1", "100", "10000"):
                    fixed = chunk if chunk != "0" else "auto"
                    rows.append(dict(op=op, pair=pair, MiB=mib, tensors=n, fixed_B=fixed,
                                     chunk="2048", kernel_us="13.5", kernel_GBps="3900", copy_GBps="4100",
                                     ratio="0.95", naive_GBps="12.5", call_us="900"))
w = csv.DictWriter(open(out, "w"), fieldnames=list(rows[0]))
w.writeheader(); w.writerows(rows)
print("fake bench_kernels done")
'''
FAKE_DDP = '''
import sys
out = sys.argv[sys.argv.index("--csv") + 1]
open(out, "w").write("mode,cap_mb,step_ms\\narrays,25,1.5\\n")
'''
FAKE_TESTS = '''
import pytest

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "planted"

def test_not_gpu():
    pass
'''


def _run(cwd, env, timeout=150):
    return subprocess.run(["bash", str(cwd / "scripts" / "gpu_check.sh")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def scratch(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "tests").mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_check.sh")
    shutil.copy(ROOT / "scripts" / "pytest_gpu_first.py", repo / "scripts")
    (repo / "scripts" / "bench_kernels.py").write_text(FAKE_BENCH)
    (repo / "scripts" / "bench_allreduce.py").write_text("import time\ntime.sleep(60)\n")
    (repo / "scripts" / "bench_ddp.py").write_text(FAKE_DDP)
    (repo / "tests" / "test_fake.py").write_text(FAKE_TESTS)
    (repo / "setup.cfg").write_text("[tool:pytest]\nmarkers =\n    gpu: needs a GPU\n")
    fake = tmp_path / "fake" / "cupy" / "cuda"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text(FAKE_CUPY)
    (fake / "__init__.py").write_text(FAKE_CUDA)
    (fake / "nccl.py").write_text(FAKE_NCCL)
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(tmp_path / "fake"),
               OUT=str(tmp_path / "out"), GPU_CHECK_ALLREDUCE_TIMEOUT="2")
    return repo, env, tmp_path / "out"


@pytest.mark.slow
def test_gpu_check_flow_summary_last_and_files(scratch):
    repo, env, out = scratch
    res = _run(repo, env)
    assert res.returncode == 1, res.stdout + res.stderr      # a test failed, a bench hung
    lines = res.stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "GPU CHECK SUMMARY")
    summary = "\n".join(lines[start:])
    assert lines[-1].startswith("=====") and len(lines) - start < 30
    assert "NVIDIA H200  (141 GiB, sm_90, 132 SMs)" in summary
    assert ('probe    RawKernel compile+launch: FAILED RuntimeError: CompileException: kern.cu(1): '
            'catastrophic error: cannot open source file "cuda_fp16.h"') in summary
    assert "cuda driver/runtime 13000/13000  cupy 14.2.0  nccl 22805" in summary
    assert "1 failed, 1 passed, 1 deselected" in summary
    assert "FAILED tests/test_fake.py::test_fails" in summary
    assert "pytest=ok" not in summary and "pytest=FAILED(rc 1)" in summary
    assert "kernels=ok" in summary and "chunks=ok" in summary and "ddp=ok" in summary
    assert "allreduce=TIMEOUT" in summary
    assert "pack   f32      x1: 3900 (0.95)  x100: 3900 (0.95)  x10000: 3900 (0.95)" in summary
    assert "chunks   pack f32 25 MiB x10000, ratio by chunk bytes: auto: 0.95  2048: 0.95" \
        in summary
    assert "ddp      1 rows" in summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["chunks.csv", "ddp.csv", "kernels.csv", "log.txt", "pytest.txt",
                     "summary.txt"]
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8
    assert summary.strip() in (out / "summary.txt").read_text()
    assert "planted" in (out / "pytest.txt").read_text()


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so(scratch):
    repo, env, out = scratch
    (repo / "tests" / "test_fake.py").write_text(FAKE_TESTS.replace("assert 1 == 2", "pass #"))
    env["PYTHONPATH"] = ""            # the real CuPy (if any) sees no GPU on this machine
    res = _run(repo, env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "NO GPU: CuPy sees no CUDA device" in res.stdout
    assert "GPU      NONE" in res.stdout and "kernels=skipped" in res.stdout
    assert "2 passed, 1 deselected" in res.stdout   # the gpu marker still selects the tests


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

    items = [Item("test_api.py", "test_a"), Item("test_nccl_backend.py", "test_n"),
             Item("test_kernels_gpu.py", "test_pack"), Item("test_torch_adapter.py", "test_t"),
             Item("test_kernels_gpu.py", "test_bf16_x"), Item("test_ddp_gpu.py", "test_d")]
    plugin.pytest_collection_modifyitems(None, None, items)
    assert [(i.path.name, i.name) for i in items] == [
        ("test_kernels_gpu.py", "test_bf16_x"), ("test_kernels_gpu.py", "test_pack"),
        ("test_torch_adapter.py", "test_t"), ("test_ddp_gpu.py", "test_d"),
        ("test_nccl_backend.py", "test_n"), ("test_api.py", "test_a")]
