"""Keras 3 on its JAX and torch backends: model.fit with nccl_ddp.keras.DistributedOptimizer and
BroadcastGlobalVariablesCallback on 2 ranks equals one process on the full batch (float64), the
grads going through the existing JAX adapter (Keras jits the step: the ordered io_callback) and
torch adapter. The TensorFlow backend is tested in .venv-tf (test_tensorflow_adapter.py). Skipped
where keras is not installed (pip install nccl_ddp[keras])."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from mp import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("keras") is None,
        reason="keras is not installed in this venv (pip install nccl_ddp[keras])",
    ),
]


def _fit(rank, world):
    import nccl_ddp as nd

    nd.init_process_group("host")
    from keras_fit import fit_and_reference

    try:
        return fit_and_reference(rank, world)
    finally:
        nd.destroy_process_group()


# Keras' torch backend itself: its float64 grads of a whole batch and the mean of its two halves'
# grads differ by 3e-8 (measured on one process, no nccl_ddp), so torch is compared at 1e-6; TF and
# JAX agree to 1e-12. Either is far below what clipping local grads would change (> 1e-3).
TOLERANCE = {"jax": 1e-12, "torch": 1e-6}


@pytest.mark.parametrize("backend, jitted", [("jax", True), ("torch", False)])
def test_keras_fit_on_backend_equals_one_process(backend, jitted):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    env = {"KERAS_BACKEND": backend, "JAX_ENABLE_X64": "1"}  # float64 in JAX too
    results = run_ranks(_fit, 2, env=env, timeout=240)
    for res in results:
        assert res["jit_compile"] is jitted  # jax: the reduction ran inside Keras' jitted step
        *weights, iterations = res["fit"]
        *ref, ref_iterations = res["ref_fit"]
        assert iterations == ref_iterations == 6
        for a, b in zip(weights, ref):
            np.testing.assert_allclose(
                np.array(a), np.array(b), rtol=TOLERANCE[backend], atol=TOLERANCE[backend]
            )
        unclipped = res["ref_fit_unclipped"][:-1]
        assert max(np.max(np.abs(np.array(a) - np.array(b))) for a, b in zip(unclipped, ref)) > 1e-3
    assert results[0]["fit"] == results[1]["fit"]


def _fit_mixed(rank, world, lso_by):
    import nccl_ddp as nd

    nd.init_process_group("host")
    from keras_fit import fit_mixed_precision

    try:
        return fit_mixed_precision(rank, world, True, lso_by), fit_mixed_precision(0, 1, False, lso_by)
    finally:
        nd.destroy_process_group()


@pytest.mark.parametrize("lso_by", ["compile", "user"])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_loss_scaling_skips_on_every_rank_alike(backend, lso_by):
    """mixed_float16: the LossScaleOptimizer around ours (compile's, or the user's) sees rank 1's
    overflow on every rank: the same 2 of 6 steps are skipped and the scale halved alike, as one
    process on the whole batch does. Before: the ranks skipped different steps (wrong weights on
    one, "peer closed the connection" on the other)."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    results = run_ranks(_fit_mixed, 2, lso_by, env={"KERAS_BACKEND": backend}, timeout=240)
    for fit, ref in results:
        assert fit[-2:] == ref[-2:] == [4, 2.0**15 / 4]  # applied steps, loss scale
        for a, b in zip(fit[:-2], ref[:-2]):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=1e-3)
    assert results[0][0] == results[1][0]


def _broadcasts(rank, world):
    import keras

    import nccl_ddp as nd
    import nccl_ddp.keras as ndk

    nd.init_process_group("host", timeout=20)
    out = {}
    try:
        a = keras.Variable(np.full(3, 1.0 + rank, np.float32), name="a")
        b = keras.Variable(np.full(3, 10.0 + rank, np.float32), name="b")
        c = keras.Variable(np.zeros(3 + rank, np.float32), name="c")
        for case, variables in {"order": [a, b] if rank == 0 else [b, a], "shape": [a, c]}.items():
            try:
                ndk.broadcast_variables(variables, root_rank=0)
                out[case] = "no error"
            except nd.errors.RankMismatchError as e:
                out[case] = str(e)
        ndk.broadcast_variables([a, b], root_rank=1)  # what matches still goes through
        out["after"] = [np.asarray(a).tolist(), np.asarray(b).tolist()]
    finally:
        nd.destroy_process_group()
    return out


def test_keras_broadcast_variables_checks_names_and_order_first():
    """Rank 0 broadcasts [a, b], rank 1 passes [b, a] (same shape and dtype): before, rank 1
    silently took a = rank 0's b; now every rank raises RankMismatchError naming the first
    difference, and nothing was overwritten."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    results = run_ranks(_broadcasts, 2, env={"KERAS_BACKEND": "torch"}, timeout=120)
    for rank, out in enumerate(results):
        assert out["order"].startswith(f"rank {rank}: the variables broadcast differ across ranks"), out
        assert (
            "variable 0: rank 0 has 'a' of shape (3,) float32, rank 1 has 'b' of shape (3,) float32"
            in out["order"]
        )
        assert "Every rank must pass the same variables in the same order" in out["order"]
        assert (
            "variable 1 ('c'): rank 0 has shape (3,) float32, rank 1 has shape (4,) float32" in out["shape"]
        )
        assert out["after"] == [[2.0] * 3, [11.0] * 3]  # rank 1's, untouched by the refused calls
