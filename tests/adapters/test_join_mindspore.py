"""MindSpore DDP inside `nccl_ddp.Join` (tests/support/ms_join.py, 2 ranks in the MindSpore venv): uneven
batches, grads divided by the ranks still training, the bf16 comm hook, check_finite, and every
rank ending with the last joiner's parameters (failed before the final sync read fresh copies of
MindSpore's parameters: rank 0 kept its own)."""

import os

import pytest
from paths import SUPPORT
from test_mindspore_adapter import PY, _problem, _run

pytestmark = [pytest.mark.skipif(bool(_problem), reason=_problem), pytest.mark.timeout(300), pytest.mark.slow]


def test_mindspore_ddp_join_with_bf16_hook(tmp_path):
    out = _run(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", os.path.join(SUPPORT, "ms_join.py")],
        str(tmp_path),
    )
    for rank in (0, 1):
        assert f"ms_join: rank {rank} passed" in out, out
