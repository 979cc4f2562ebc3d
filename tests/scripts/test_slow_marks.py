"""The conftest check that keeps `--fast` fast: unmarked tests over the limit are listed, and fail
the run under NCCL_DDP_STRICT_SLOW=1."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

SAMPLE = """
import time, pytest
def test_unmarked_sleeper(): time.sleep(0.4)
@pytest.mark.slow
def test_marked_sleeper(): time.sleep(0.4)
def test_quick(): pass
"""
INI = "[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n"


def _run(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "tests" / "support" / "gpu_probe.py", tmp_path / "gpu_probe.py")  # conftest's
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text(INI)
    env = dict(os.environ, NCCL_DDP_SLOW_LIMIT_S="0.2", NCCL_DDP_STRICT_SLOW="1" if strict else "0")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_unmarked_slow_test_is_listed_and_fails_only_when_strict(tmp_path):
    loose = _run(tmp_path, strict=False)
    assert loose.returncode == 0, loose.stdout
    listed = loose.stdout.split("mark them slow", 1)[1]
    assert "test_unmarked_sleeper" in listed
    assert "test_marked_sleeper" not in listed and "test_quick" not in listed
    strict = _run(tmp_path, strict=True)
    assert strict.returncode == 1, strict.stdout
