"""`nd.ShardedParams` (ZeRO-3) over Paddle tensors, 2 ranks under nccl-ddp-run in the Paddle
venv: gathers come back as Paddle tensors; after several steps of each rank's own grads the
parameters equal the same fused AdamW run unsharded on the mean grads (NumPy) bit for bit on
both ranks; grads of another framework or count are refused naming the rank; and
examples/zero3_paddle.py trains to the same parameters on both ranks."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import paddle_venv
import pytest
from paddle_venv import PY, ROOT, VENV
from paths import SUPPORT

import nccl_ddp as nd

TIMEOUT = 150
pytestmark = [
    pytest.mark.skipif(
        paddle_venv.missing("paddle"), reason=f"no Paddle venv at {VENV}: run scripts/setup_paddle_venv.sh"
    ),
    pytest.mark.slow,
    pytest.mark.timeout(2 * TIMEOUT + 60),
]


def _launch(script: str, *args: str, cwd) -> str:
    return paddle_venv.run(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", script, *args], cwd, TIMEOUT
    )


def _unsharded(checks):
    master = np.concatenate([x.ravel() for x in checks.init()])
    opt = checks.opt()
    state = opt.init_state(master)
    for step in range(checks.STEPS):
        g = [checks.grads(r, step) for r in range(2)]
        opt.step(master, np.concatenate([((a + b) / np.float32(2)).ravel() for a, b in zip(*g)]), state)
    ends = np.cumsum([int(np.prod(s)) for s in checks.SHAPES])
    return [x.reshape(s) for x, s in zip(np.split(master, ends[:-1]), checks.SHAPES)]


def test_paddle_tensors_sharded_equal_unsharded_bitwise(tmp_path):
    log = _launch(os.path.join(SUPPORT, "paddle_sharded.py"), str(tmp_path), cwd=tmp_path)
    assert log.count("paddle_sharded: rank") == 2, log[-3000:]
    import paddle_sharded as checks

    want = _unsharded(checks)
    assert isinstance(checks.opt(), nd.ShardAdamW)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["types"] == ["Tensor"], seen
        assert seen["numpy"].startswith(f"rank {rank}: ShardedParams.step") and "paddle" in seen["numpy"], (
            seen
        )
        assert f"rank {rank}" in seen["short"] and "3 leaves" in seen["short"], seen
        got = np.load(tmp_path / f"rank{rank}.npz")
        for i, ref in enumerate(want):
            np.testing.assert_array_equal(got[f"arr_{i}"], ref, err_msg=f"rank {rank} leaf {i}")


def test_zero3_paddle_example(tmp_path):
    """examples/zero3_paddle.py: both ranks end with the same parameters, each trained on its own data."""
    out = _launch(os.path.join(ROOT, "examples", "zero3_paddle.py"), "--steps", "6", cwd=tmp_path)
    sums = re.findall(r"rank (\d): param checksum (\S+)", out)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({c for _, c in sums}) == 1, out[-3000:]
    losses = re.findall(r"\[rank (\d)\] step 0: loss (\S+)", out)
    assert len({loss for _, loss in losses}) == 2, out[-3000:]
