"""The TensorFlow 2 / Keras 3 adapter on 2 ranks under nccl-ddp-run, against one process on the
full batch (tests/support/tf_checks.py computes both; float64, so only the order of additions can
differ): GradientTape + DistributedGradReducer eagerly and inside tf.function, Keras model.fit with
DistributedOptimizer(Adam(clipnorm=...)) + BroadcastGlobalVariablesCallback from different initial
weights, the functional collectives on tensors and variables, and bad inputs named by parameter;
and Keras model.fit against TensorFlow's own MultiWorkerMirroredStrategy (tf_keras, tf_mwms.py).

TensorFlow runs only in .venv-tf (scripts/setup_tf_venv.sh, or $NCCL_DDP_TF_VENV), never in this
process; without it these tests skip, saying why. Two launches (about 25 and 35 s) serve every test."""

from __future__ import annotations

import re

import numpy as np
import pytest
from paths import ROOT
from tf_venv import PY, run_tf, two_ranks, venv_problem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LAUNCH = [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """[rank 0's results, rank 1's] of one 2-rank launch of tf_checks.py."""
    return two_ranks(LAUNCH, "tf_checks.py", tmp_path_factory.mktemp("tf_checks"), "rank")


def _close(a, b, rtol=1e-12, atol=1e-12):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x, dtype=float), np.array(y, dtype=float), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_tape_and_reducer_equal_one_process_on_the_full_batch(ranks, mode):
    for res in ranks:
        w, b, kinds = res[mode]
        ref_w, ref_b, _ = res["ref_tape"]
        _close([w, b], [ref_w, ref_b])
        assert kinds == ["EagerTensor"]  # TensorFlow tensors come back, not NumPy arrays
    assert ranks[0][mode][:2] == ranks[1][mode][:2]  # bitwise equal across ranks


def test_keras_fit_with_distributed_optimizer_equals_one_process(ranks):
    """Ranks start from different weights (the callback gives rank 0's) and fit half batches
    with Adam(clipnorm=0.05); the result is one process fitting the whole batches, so the clip
    saw the mean grads (clipping is active: the unclipped run ends elsewhere)."""
    for res in ranks:
        *weights, iterations = res["fit"]
        *ref, ref_iterations = res["ref_fit"]
        assert iterations == ref_iterations == 6
        _close(weights, ref)
        unclipped = res["ref_fit_unclipped"][:-1]
        assert max(np.max(np.abs(np.array(a) - np.array(b))) for a, b in zip(unclipped, ref)) > 1e-3
    assert ranks[0]["fit"] == ranks[1]["fit"]


@pytest.mark.parametrize("what", ["accumulate", "loss_scale"])
def test_keras_machinery_after_the_reduction_equals_one_process(ranks, what):
    """gradient_accumulation_steps=2 (Keras accumulates the mean grads: 3 applied updates of 6
    steps) and LossScaleOptimizer (the scaled grads are reduced, then unscaled) around Adam."""
    for res in ranks:
        *weights, iterations = res["fit_" + what]
        *ref, ref_iterations = res["ref_fit_" + what]
        assert iterations == ref_iterations
        _close(weights, ref)
    assert ranks[0]["fit_" + what] == ranks[1]["fit_" + what]


@pytest.mark.parametrize("lso_by", ["compile", "user"])
def test_keras_loss_scaling_skips_on_every_rank_alike(ranks, lso_by):
    """mixed_float16, rank 1's grads overflow in 2 of 6 steps: the LossScaleOptimizer around ours
    (compile's, or the user's) skips those steps on both ranks and halves the scale alike, as one
    process on the whole batch does (before: the ranks skipped different steps)."""
    for res in ranks:
        fit, ref = res["mixed_" + lso_by]
        assert fit[-2:] == ref[-2:] == [4, 2.0**15 / 4]  # applied steps, loss scale
        _close(fit[:-2], ref[:-2], rtol=1e-3, atol=1e-3)
    assert ranks[0]["mixed_" + lso_by][0] == ranks[1]["mixed_" + lso_by][0]


def test_collectives_on_tensors_and_variables(ranks):
    for rank, res in enumerate(ranks):
        c = res["collectives"]
        assert c["tensor"] == ["EagerTensor", [3.0, 6.0], [1.0 * (rank + 1), 2.0 * (rank + 1)]]
        assert c["variable"] == [True, [1.0, 11.0]]  # max over ranks, assigned to the variable
        assert c["keras_variable"] == [True, [6.0, 6.0, 6.0]]  # rank 1's, broadcast
        assert c["float64_dtype"] == "float64"
        assert c["bfloat16"] == ["bfloat16", [4.0], "bfloat16", [2.0, 2.0]]
        assert c["in_graph"] == [3.0]  # tf.numpy_function around nd.all_reduce, in tf.function


@pytest.mark.parametrize(
    "case, match",
    [
        ("numpy", r"ConfigTypeError: grads\[0\] is a numpy.ndarray .*built on TensorFlow parameters"),
        (
            "dtype",
            r"ConfigError: grad 'w:0' \(grads\[0\]\): dtype differs: the grad is float64, "
            "its parameter float32",
        ),
        ("shape", r"ConfigError: grad 'w:0' \(grads\[0\]\): shape differs"),
        ("none", r"ConfigError: grads\[0\] is None: .*tf.zeros_like"),
        ("mixed_params", r"ConfigTypeError: parameters\[1\] is a numpy.ndarray"),
        ("xla", r"XLA cannot call back into Python.*jit_compile=False"),
        ("optimizer_type", r"ConfigTypeError: optimizer must be a Keras 3 optimizer .*got builtins.str"),
        ("optimizer_twice", r"ConfigError: optimizer is a DistributedOptimizer already"),
        ("symbolic", r"symbolic .*inside tf.function.* cannot go through a collective.*tf.numpy_function"),
        ("ddp", r"ConfigTypeError: Keras models have no DistributedDataParallel.*DistributedOptimizer"),
    ],
)
def test_bad_inputs_are_refused_naming_the_parameter(ranks, case, match):
    for res in ranks:
        assert re.search(match, res["bad"][case], re.S), res["bad"][case]
        assert res["bad"]["after"] == [[[1.0, 1.0]] * 3, [1.0, 1.0]]  # the reducer still works


def test_broadcast_callback_is_a_keras_callback_class(ranks):
    for res in ranks:
        assert res["callback_class"] == [True, 1]


def test_keras_jit_compile_is_refused(ranks):
    for res in ranks:
        assert res["keras_jit"].startswith("ConfigError: DistributedGradReducer was traced inside an XLA")


@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    """[rank 0's, rank 1's] results of one 2-rank launch of tf_mwms.py."""
    return two_ranks(LAUNCH, "tf_mwms.py", tmp_path_factory.mktemp("tf_mwms"), "mwms")


@pytest.mark.parametrize("clip", ["", "_unclipped"], ids=["clipnorm", "unclipped"])
def test_keras_fit_equals_multi_worker_mirrored_strategy(mwms, clip):
    """TensorFlow's own data parallelism as the oracle: tf_keras model.fit under
    MultiWorkerMirroredStrategy on the same ranks, shards and initial weights (bitwise equal here)."""
    for res in mwms:
        _close(res["ours" + clip], res["mwms" + clip])
    assert mwms[0]["mwms"] != mwms[0]["mwms_unclipped"]  # the clip is active


def test_keras_fit_example_ends_with_identical_weights(tmp_path):
    """examples/keras_fit.py (the docs' one-line change) on 2 ranks: every rank prints the same
    weight checksum."""
    problem = venv_problem()
    if problem:
        pytest.skip(problem)
    example = str(ROOT / "examples" / "keras_fit.py")
    out = run_tf(
        [PY, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", example, "--epochs", "2"], str(tmp_path)
    )
    sums = re.findall(r"^\[rank \d\] rank \d: loss [0-9.]+, weight checksum (\S+)$", out, flags=re.M)
    assert len(sums) == 2 and sums[0] == sums[1], out
