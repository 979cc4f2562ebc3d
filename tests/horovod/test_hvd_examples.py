"""Horovod's own examples, adapted copies in examples/horovod/ (the import replaced; see each
file's header), launched by our `horovodrun -np 2`: their parameters after a few steps equal a
single process trained on the full batch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from paths import ROOT  # noqa: E402

ARGS = ["--no-cuda", "--model", "tiny", "--image-size", "12", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "2"]  # fmt: skip


def _run(cmd: list, tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_pytorch_synthetic_benchmark_two_ranks_equal_one_on_the_full_batch(tmp_path):
    script = str(ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py")
    horovodrun = [sys.executable, "-m", "nccl_ddp.launch.horovodrun", "-np", "2", "-H", "localhost:2"]
    _run([*horovodrun, "python", script, *ARGS, "--batch-size", "4", "--save-params", "two.npz"], tmp_path)
    # one process, the whole batch of 8, the learning rate the example scales for 2 workers
    _run(
        [sys.executable, script, *ARGS, "--batch-size", "8", "--base-lr", "0.02", "--save-params", "one.npz"],
        tmp_path,
    )
    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    assert sorted(two) == sorted(one) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6, err_msg=k)
