"""The MindSpore adapter: the two examples from MindSpore's docs (the grad reducer's in GRAPH_MODE
as documented, and in PyNative mode) and the LeNet training in GRAPH_MODE, run on CPU with 2
processes through nccl-ddp-run, checked against single-process references (tests/support/ms_reference.py,
computed once per module: MindSpore takes seconds to start).

MindSpore 2.10 needs numpy<2, so everything MindSpore runs in the .venv-ms venv made by
scripts/setup_ms_venv.sh (or $NCCL_DDP_MS_VENV); without it these tests are skipped.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from ms_venv import PY, VENV_PROBLEM, run_ms
from paths import ROOT as REPO
from paths import SUPPORT

ROOT = str(REPO)
# each test starts up to 2 launches of 2 MindSpore processes (150 s bound each): beyond the default
pytestmark = [
    pytest.mark.skipif(bool(VENV_PROBLEM), reason=VENV_PROBLEM),
    pytest.mark.timeout(420),
    pytest.mark.slow,
]


def _launch(example: str, *args: str, cwd: str) -> str:
    out = run_ms(
        [
            PY,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            os.path.join(ROOT, "examples", example),
            *args,
        ],
        cwd,
    )
    # before: 42 lines over the three examples (dtype_to_nptype, set_context(device_target))
    assert "deprecated" not in out, out
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """name -> the reference parameters (ddp, grad-reducer-{sum,mean}-{docs,scaled})."""
    out = tmp_path_factory.mktemp("ms_reference")
    run_ms(
        [PY, os.path.join(SUPPORT, "ms_reference.py"), "all", str(out), "--steps", "4", "--world", "2"],
        str(out),
    )
    return lambda name: np.load(out / f"{name}.npz")


def _assert_params_equal(a, b, rtol: float, atol: float = 0.0) -> None:
    assert sorted(a.files) == sorted(b.files), (a.files, b.files)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def _rank_lines(out: str, rank: int, pattern: str) -> list:
    return re.findall(rf"^\[rank {rank}\] {pattern}$", out, flags=re.M)


def _check_training_output(out: str) -> None:
    for rank in (0, 1):
        assert len(_rank_lines(out, rank, r"epoch: 0, step: \d, loss is [0-9.]+")) == 4, out
    sums = [_rank_lines(out, r, r"param checksum: (\S+)") for r in (0, 1)]
    assert sums[0] and sums[0] == sums[1], out


def test_ddp_example_matches_mean_of_rank_grads(tmp_path, reference):
    """DDP (AVG in the collective, static graph, value_and_grad + hooks) over 4 AdamWeightDecay
    steps equals one process applying the mean of both ranks' grads."""
    ours = tmp_path / "ours.npz"
    out = _launch("ms_ddp_lenet.py", "--steps", "4", "--save", str(ours), cwd=str(tmp_path))
    _check_training_output(out)
    a = np.load(ours)
    assert len(a.files) == 8
    _assert_params_equal(a, reference("ddp"), rtol=1e-5, atol=1e-6)


def test_lenet_graph_mode_equals_pynative(tmp_path, reference):
    """The LeNet training with nn.TrainOneStepCell + our reducer compiled (GRAPH_MODE) gives
    every rank the parameters of the same run in PyNative mode, and of the mean-grad reference."""
    runs = {}
    for mode in ("graph", "pynative"):
        save = str(tmp_path / f"{mode}-{{rank}}.npz")
        out = _launch("ms_lenet_graph.py", "--mode", mode, "--steps", "4", "--save", save, cwd=str(tmp_path))
        _check_training_output(out)
        runs[mode] = [np.load(save.format(rank=r)) for r in (0, 1)]
    graph, pynative = runs["graph"], runs["pynative"]
    _assert_params_equal(graph[0], graph[1], rtol=0)
    _assert_params_equal(graph[0], pynative[0], rtol=1e-6, atol=1e-7)
    _assert_params_equal(graph[0], reference("ddp"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("variant", ["docs", "scaled-mean"])
def test_grad_reducer_example(tmp_path, reference, mode, variant):
    """The docs' TrainingWrapper (GRAPH_MODE as documented, and PyNative) prints 256.0 on rank 0
    (rank r with inputs scaled by r+1: 256 (r+1)^2) and every rank's Momentum step uses the sum of
    both ranks' grads (the docs' context, gradients_mean False) or, with --mean, their mean."""
    scaled = variant == "scaled-mean"
    flags = ["--scale-by-rank", "--mean"] if scaled else []
    save = str(tmp_path / "weight-{rank}.npz")
    out = _launch("ms_grad_reducer.py", "--mode", mode, *flags, "--save", save, cwd=str(tmp_path))
    for rank in (0, 1):
        want = 256.0 * ((rank + 1) ** 2 if scaled else 1)
        assert _rank_lines(out, rank, re.escape(f"{want}")), out
    ref = reference("grad-reducer-mean-scaled" if scaled else "grad-reducer-sum-docs")["weight"]
    for rank in (0, 1):
        np.testing.assert_allclose(np.load(save.format(rank=rank))["weight"], ref, rtol=1e-6)


def test_ms_checks_in_venv(tmp_path):
    """Single-process behaviours (tests/support/ms_checks.py): DDP's graph-mode refusal, zero-copy out,
    accumulation until zero_grad; the reducer Cell in a compiled construct (buckets per dtype and
    fusion id, mean/degree) against PyNative, a PyNative `@ms.jit` step, our ReducerError out of a
    compiled step."""
    out = run_ms([PY, os.path.join(SUPPORT, "ms_checks.py")], str(tmp_path))
    assert "ms_checks: all passed" in out, out


def test_ddp_syncs_frozen_params_and_buffers(tmp_path):
    """The wrapper is an nn.Cell with the wrapped cell's parameter names (a checkpoint of it loads
    into the bare cell). Frozen Parameters, BatchNorm statistics and registered buffers start as
    rank 0's on both ranks; after a step moved the statistics locally, the next forward takes
    rank 0's again."""
    out = run_ms(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", os.path.join(SUPPORT, "ms_state_sync.py")],
        str(tmp_path),
    )
    import json

    seen = {
        int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"\[rank (\d)\] ms_state_sync (.*)", out)
    }
    assert sorted(seen) == [0, 1], out[-3000:]
    r0, r1 = seen[0], seen[1]
    for r in (r0, r1):
        assert r["cell"] and r["checkpoint"]
        assert r["names"][0] == r["names"][1] and "w" in r["names"][0]  # no "module." prefix
        assert r["names"][2] == ["w", "bn.gamma", "bn.beta"]
    assert r1["built"] == r0["built"] and r0["built"]["frozen"] == [0.0] * 3
    assert r0["built"]["count"] == [10.0] and r0["built"]["mean"] == [0.0] * 3
    assert r1["after_step"]["mean"] != r0["after_step"]["mean"]  # different data per rank
    assert r1["after_step"]["w"] == r0["after_step"]["w"]
    assert r1["next_forward"]["mean"] == r0["after_step"]["mean"]
    assert r1["next_forward"]["count"] == [50.0]  # rank 0's, set before forward
    assert r0["next_forward"] == r1["next_forward"]
