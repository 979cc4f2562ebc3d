"""examples/zero3_numpy.py and examples/zero3_jax.py through the launcher, 2 host ranks: every
rank ends with the same parameters after training on batches of its own, and the loss goes down.
(examples/zero3_paddle.py runs in tests/adapters/paddle_tests/test_paddle_sharded_params.py.)"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from paths import ROOT


def _launch(example: str, *args: str, timeout: float = 150) -> str:
    env = dict(os.environ, NCCL_DDP_NO_PROGRESS="1")
    path = os.path.join(ROOT, "examples", example)
    r = subprocess.run(
        [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", path, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _check(out: str) -> None:
    sums = re.findall(r"rank (\d): param checksum (\S+);", out)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({c for _, c in sums}) == 1, out
    for rank in "01":
        losses = [float(x) for x in re.findall(rf"\[rank {rank}\] step \d+: loss (\S+)", out)]
        assert len(losses) == 5 and losses[-1] < losses[0], (rank, losses)
    firsts = re.findall(r"\[rank \d\] step 0: loss (\S+)", out)
    assert len(set(firsts)) == 2, out  # each rank trained on its own data


@pytest.mark.slow
def test_zero3_numpy_example():
    _check(_launch("zero3_numpy.py", "--steps", "20"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_zero3_jax_example():
    _check(_launch("zero3_jax.py", "--steps", "20"))
