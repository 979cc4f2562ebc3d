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
