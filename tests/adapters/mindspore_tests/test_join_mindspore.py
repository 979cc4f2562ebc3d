"""MindSpore DDP inside `nccl_ddp.Join` (tests/support/ms_join.py, 2 ranks in the MindSpore venv): uneven
batches, grads divided by the ranks still training, the bf16 comm hook, check_finite, and every
rank ending with the last joiner's parameters (failed before the final sync read fresh copies of
MindSpore's parameters: rank 0 kept its own)."""

import os

import pytest
from ms_venv import PY, VENV_PROBLEM, run_ms
from paths import SUPPORT

pytestmark = [
    pytest.mark.skipif(bool(VENV_PROBLEM), reason=VENV_PROBLEM),
    pytest.mark.timeout(300),
    pytest.mark.slow,
]


def test_mindspore_ddp_join_with_bf16_hook(tmp_path):
    out = run_ms(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", os.path.join(SUPPORT, "ms_join.py")],
        str(tmp_path),
    )
    for rank in (0, 1):
        assert f"ms_join: rank {rank} passed" in out, out
