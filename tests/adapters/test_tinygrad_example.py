"""tinygrad, a framework without DLPack, through NumPy: examples/tinygrad_mlp.py on 2 ranks under
nccl-ddp-run ends where the same script on 1 rank with the whole batch ends (float32 rounding
apart), both ranks alike; a tinygrad tensor given to nccl_ddp is refused naming the way out.

tinygrad lives in the Paddle venv (scripts/setup_paddle_venv.sh; pure Python). It runs on its
Python backend (DEV=PYTHON): its CPU backend needs clang, which CI machines lack. Skipped without
the venv.
"""

from __future__ import annotations

import os
import re

import numpy as np
import paddle_venv
import pytest
from paddle_venv import PY, ROOT, VENV

TIMEOUT = 240

_missing = paddle_venv.missing("tinygrad")
pytestmark = [
    pytest.mark.skipif(_missing, reason=f"no tinygrad in {VENV}: run scripts/setup_paddle_venv.sh"),
    pytest.mark.slow,
    pytest.mark.timeout(2 * TIMEOUT + 60),
]


def _run(args: list, cwd) -> str:
    return paddle_venv.run(args, cwd, TIMEOUT, DEV="PYTHON")


def test_example_on_2_ranks_equals_1_rank_on_the_whole_batch(tmp_path):
    example = os.path.join(ROOT, "examples", "tinygrad_mlp.py")
    runs = {}
    for n in (1, 2):
        save = tmp_path / f"world{n}.npz"
        out = _run(
            [
                PY,
                "-m",
                "nccl_ddp.launch",
                "--nproc-per-node",
                str(n),
                example,
                "--steps",
                "2",
                "--save",
                str(save),
            ],
            tmp_path,
        )
        sums = re.findall(r"rank \d: param checksum (\S+)", out)
        assert len(sums) == n and len(set(sums)) == 1, out[-3000:]  # every rank alike
        runs[n] = np.load(save)
    assert len(runs[1].files) == 4
    for k in runs[1].files:
        np.testing.assert_allclose(runs[2][k], runs[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_tinygrad_tensor_refused_with_the_way_out(tmp_path):
    code = (
        "import numpy as np, nccl_ddp as nd\n"
        "from tinygrad import Tensor\n"
        "nd.init_process_group()\n"
        "t = Tensor(np.ones(3, np.float32))\n"
        "for f in (lambda: nd.all_reduce(t), lambda: nd.DistributedGradReducer([t])):\n"
        "    try:\n"
        "        f()\n"
        "    except nd.errors.ConfigTypeError as e:\n"
        "        assert 'tinygrad' in str(e) and 'x.numpy()' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('a tinygrad tensor was accepted')\n"
        "print('refused')\n"
    )
    assert "refused" in _run([PY, "-c", code], tmp_path)
