"""The PaddlePaddle adapter against `paddle.DataParallel` (gloo on the CPU), 2 ranks under
nccl-ddp-run: our DistributedDataParallel of a `paddle.nn.Layer` and our DistributedGradReducer on
Paddle's grads end bitwise equal to Paddle's own data parallelism from the same seeds, no_sync()
steps included; state_dict keys and parameter names are Paddle's; BatchNorm statistics come from
rank 0. The job runs once per module (tests/support/paddle_checks.py); the single-process checks
cover bad inputs.

Paddle runs in the .venv-paddle venv made by scripts/setup_paddle_venv.sh (or
$NCCL_DDP_PADDLE_VENV), apart from TensorFlow (importing both in one process segfaults); without
it these tests are skipped.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import paddle_venv
import pytest
from paddle_venv import PY, ROOT, VENV
from paths import SUPPORT

TIMEOUT = 150
STATS = ("1._mean", "1._variance")  # BatchNorm's running statistics; the rest are parameters

_missing = paddle_venv.missing("paddle")
pytestmark = [
    pytest.mark.skipif(_missing, reason=f"no Paddle venv at {VENV}: run scripts/setup_paddle_venv.sh"),
    pytest.mark.slow,
    pytest.mark.timeout(2 * TIMEOUT + 60),
]


def _run(args: list, cwd) -> str:
    return paddle_venv.run(args, cwd, TIMEOUT)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """rank -> (arrays, names) of the 2-rank job."""
    out = tmp_path_factory.mktemp("paddle")
    log = _run(
        [
            PY,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            os.path.join(SUPPORT, "paddle_checks.py"),
            "train",
            str(out),
        ],
        out,
    )
    assert log.count("paddle_checks: rank") == 2, log[-3000:]
    return {
        r: (np.load(out / f"rank{r}.npz"), json.loads((out / f"rank{r}.json").read_text())) for r in (0, 1)
    }


def _keys(arrays, prefix: str) -> list:
    return sorted(k.split("/", 1)[1] for k in arrays.files if k.startswith(prefix + "/"))


def test_ddp_bitwise_equal_to_paddle_data_parallel(trained):
    """Every parameter of our DDP equals paddle.DataParallel's bit for bit on both ranks, after 6
    Momentum steps with two no_sync() steps; both moved away from the initial weights."""
    for rank in (0, 1):
        a, _ = trained[rank]
        params = [k for k in _keys(a, "ours") if k not in STATS]
        assert len(params) == 6, params
        for k in params:
            np.testing.assert_array_equal(a[f"ours/{k}"], a[f"paddle/{k}"], err_msg=f"rank {rank} {k}")
            assert not np.array_equal(a[f"ours/{k}"], a[f"init/{k}"]), k
        other, _ = trained[1 - rank]
        for k in params:
            np.testing.assert_array_equal(a[f"ours/{k}"], other[f"ours/{k}"], err_msg=k)


def test_grad_reducer_bitwise_equal_to_paddle_data_parallel(trained):
    """DistributedGradReducer on [p.grad ...] (grads accumulated over the no_sync() steps, reduced
    at step 4) gives the same parameters and, each rank keeping its own BatchNorm statistics as
    Paddle does, the same statistics as paddle.DataParallel."""
    for rank in (0, 1):
        a, _ = trained[rank]
        for k in _keys(a, "reducer"):
            np.testing.assert_array_equal(a[f"reducer/{k}"], a[f"paddle/{k}"], err_msg=f"rank {rank} {k}")


def test_find_unused_parameters_bitwise_equal_to_paddle(trained):
    """find_unused_parameters=True (ours with finalize() after backward), the ranks using different
    heads of one model: step 1 each head used by one rank, step 2 the other way round, step 3 one
    head unused by every rank; the parameters equal paddle.DataParallel's bit for bit."""
    for rank in (0, 1):
        a, _ = trained[rank]
        keys = _keys(a, "unused_ours")
        assert len(keys) == 6, keys
        for k in keys:
            np.testing.assert_array_equal(
                a[f"unused_ours/{k}"], a[f"unused_paddle/{k}"], err_msg=f"rank {rank} {k}"
            )


def test_find_unused_parameters_without_finalize_says_to_call_it(tmp_path):
    """find_unused_parameters=True, the ranks using different heads, no finalize() after
    backward: the next forward's error says to call finalize() (before: it suggested passing
    find_unused_parameters=True, which was on)."""
    script = os.path.join(SUPPORT, "paddle_checks.py")
    log = _run(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", script, "no_finalize", str(tmp_path)], tmp_path
    )
    assert log.count("paddle_checks: rank") == 2, log[-3000:]
    for rank in (0, 1):
        msg = (tmp_path / f"nofinalize{rank}.txt").read_text()
        assert msg.startswith(f"ReducerError: rank {rank}: Expected to have finished reduction"), msg
        assert "find_unused_parameters=True is on, but nothing ended that step: call finalize()" in msg, msg
        assert "You can enable unused parameter detection" not in msg, msg


def test_state_dict_keys_and_parameter_names_are_paddles(trained):
    for rank in (0, 1):
        _, names = trained[rank]
        assert names["ours_state_dict"] == names["paddle_state_dict"]
        assert names["ours_state_dict"][:2] == ["0.weight", "0.bias"]
        assert names["ours_named_parameters"] == names["paddle_named_parameters"]
        assert names["ours_named_parameters"][0] == "_layers.0.weight"


def test_buffers_come_from_rank_0(trained):
    """Construction gives rank 1 rank 0's BatchNorm statistics (both DDPs); after training, the
    evaluation forward gives it rank 0's again with ours (broadcast_buffers), while Paddle's
    keeps rank 1's own, so the ranks' statistics really differed."""
    (a0, _), (a1, _) = trained[0], trained[1]
    for k in STATS:
        np.testing.assert_array_equal(a0[f"ours/{k}"], a0[f"paddle/{k}"], err_msg=k)
        np.testing.assert_array_equal(a1[f"ours/{k}"], a0[f"ours/{k}"], err_msg=k)
        assert not np.array_equal(a1[f"paddle/{k}"], a0[f"paddle/{k}"]), k


def test_single_process_checks(tmp_path):
    """tests/support/paddle_checks.py single: mixed frameworks, dtypes and shapes refused naming
    the parameter, paddle.DataParallel's options we cannot honour, an error raised inside
    backward, find_unused_parameters, float16/float64/bfloat16 kept."""
    out = _run([PY, os.path.join(SUPPORT, "paddle_checks.py"), "single"], tmp_path)
    assert "paddle_checks: all passed" in out, out[-3000:]


def test_paddle_data_parallel_docs_example(tmp_path):
    """examples/paddle_ddp.py, paddle.DataParallel's documented example with two lines changed:
    both ranks end with the same parameters from different initial layers and data."""
    out = _run(
        [
            PY,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            os.path.join(ROOT, "examples", "paddle_ddp.py"),
        ],
        tmp_path,
    )
    sums = re.findall(r"rank (\d): param checksum (\S+)", out)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({c for _, c in sums}) == 1, out[-3000:]
    losses = re.findall(r"\[rank (\d)\] step 0: loss (\S+)", out)
    assert len({loss for _, loss in losses}) == 2, out[-3000:]  # each rank trained on its own data
