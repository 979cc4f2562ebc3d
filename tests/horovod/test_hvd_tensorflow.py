"""nccl_ddp.horovod.tensorflow[.keras] on 2 ranks under our `horovodrun -np 2`, in .venv-tf:
collectives against NumPy (eager and inside tf.function), DistributedGradientTape against one
process on the full batch, the Keras callbacks, bad inputs named; and Horovod's own TensorFlow
examples (adapted copies in examples/horovod/, the import replaced) against one process on the
full batch. TensorFlow never runs in this process (tests/support/tf_venv.py)."""

from __future__ import annotations

import numpy as np
import pytest
from paths import ROOT
from tf_venv import PY, run_tf, two_ranks, venv_problem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
HOROVODRUN = [PY, "-m", "nccl_ddp.launch.horovodrun", "-np", "2", "-H", "localhost:2", "python"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks(HOROVODRUN, "hvd_tf_checks.py", tmp_path_factory.mktemp("hvd_tf"), "rank")


def test_collectives_on_tensors_eager_and_in_tf_function(ranks):
    r0, r1 = ranks
    assert r0["ids"] == [0, 2, 0, 2, 0, 1] and r1["ids"] == [1, 2, 1, 2, 0, 1]
    t0, t1 = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])
    for r in ranks:
        c = r["collectives"]
        assert c["average"] == ((t0 + t1) / 2).tolist()
        assert c["sum"] == (t0 + t1).tolist() and c["max"] == t1.tolist()
        assert c["scaled"] == ((2 * t0 + 2 * t1) * 0.25).tolist()
        assert c["fp16"][0] == "float32"
        np.testing.assert_allclose(c["fp16"][1], (t0 + t1) / 6, rtol=1e-3)
        assert c["grouped"] == [(t0 + t1).tolist(), [3.0, 3.0]]
        assert c["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert c["broadcast"] == t1.tolist()
        assert c["object"] == {"r": 1} and c["objects"] == [0, 1]
        assert c["variable"] == [1.0, 5.0]
        assert c["graph"] == [(t0 + t1).tolist(), [*t0, *t1], t0.tolist()]
    rows = np.arange(10.0).reshape(5, 2) * 3
    assert r0["collectives"]["reducescatter"] == rows[:3].tolist()
    assert r1["collectives"]["reducescatter"] == rows[3:].tolist()
    assert r0["collectives"]["alltoall"] == [[0.0, 10.0, 11.0], [1, 2]]
    assert r1["collectives"]["alltoall"] == [[1.0, 2.0, 12.0], [2, 1]]


def test_bad_inputs_are_named(ranks):
    for r in ranks:
        c = r["collectives"]
        assert "op=hvd.Adasum is not supported" in c["adasum"]
        assert "unknown op 9" in c["unknown_op"]
        assert (
            c["mismatch"].startswith("HorovodMismatchError")
            and "Mismatched allgather tensor shapes" in c["mismatch"]
        )
        assert "float32[2, 3]" in c["mismatch"]
        assert "op must be hvd.Average or hvd.Sum" in c["tape_op"]
        assert "gradient_accumulation_steps=2 both accumulate" in c["keras_passes"]
        assert "not a Keras 3 optimizer" in c["v1_optimizer"]


@pytest.mark.parametrize("mode, tol", [("tape_eager", 1e-12), ("tape_graph", 1e-12), ("tape_fp16", 2e-3)])
def test_distributed_gradient_tape_equals_one_process_on_the_full_batch(ranks, mode, tol):
    for r in ranks:
        assert r[mode][0] < tol, r[mode][0]
        if mode == "tape_fp16":
            assert r[mode][2] > 0  # float16 on the wire: not the uncompressed result
    assert ranks[0][mode][1] == ranks[1][mode][1]


def test_keras_callbacks(ranks):
    for r in ranks:
        cb = r["callbacks"]
        # warm-up over 2 epochs of 2 batches: 0.04 / 2 * (epoch * (2 - 1) / 2 + 1), epoch counted
        # at each batch's end as Horovod does; from epoch 2 on it stays where it ended
        epochs = [0.5, 1.0, 1.5, 2.0]
        expect = [0.04 / 2 * (e / 2 + 1) for e in epochs] + [0.04, 0.04]
        np.testing.assert_allclose(cb["warmup_rates"], expect, rtol=1e-6)
        # schedule: 0.04 * 0.5 ** (epoch - 1) from epoch 1 (staircase); epoch 0 keeps the rate
        np.testing.assert_allclose(cb["schedule_rates"], [0.04] * 4 + [0.02] * 2, rtol=1e-6)
        assert all(np.isfinite(cb["loss"]))
    # MetricAverageCallback: every rank logs the mean loss (each rank's data differ); the weights agree
    assert ranks[0]["callbacks"]["loss"] == ranks[1]["callbacks"]["loss"]
    assert ranks[0]["callbacks"]["weights"] == ranks[1]["callbacks"]["weights"]


def test_ops_for_the_ranks_uint16_and_broadcast_in_place_returning_its_result(ranks):
    for r, res in enumerate(ranks):
        b = res["semantics"]["basics"]
        assert b["ops"] == [r, 2, r, 2] and b["ccl"] is False and b["eagerly"] is True
        assert b["broadcast_"] == [[1.0] * 3, [1.0] * 3]  # eager broadcast_ returns the values
        assert b["uint16"] == [
            [0, 60000, 1, 60000],
            [1, 60000],
            [0, 1] if r == 0 else [60000, 60000],
            "uint16",
        ]
        assert b["grouped_allgather"] == [[0, 60000, 1, 60000], [1.0, 1.0, 1.0]]
        assert b["grouped_reducescatter"] == [[[3.0], [3.0]]]


def test_errors_are_horovods_tf_errors_and_the_group_stays_usable(ranks):
    mismatch = ["FailedPreconditionError", "RankMismatchError", "RuntimeError"]
    for res in ranks:
        e = res["semantics"]["errors"]
        assert e["shape"] == e["rank_of_tensor"] == e["dtype"] == e["root"] == mismatch
        assert e["gather_shape"] == e["alltoall_dtype"] == mismatch
        assert e["splits"][0] == "InvalidArgumentError"
        assert e["sparse_min"] == e["sparse_scaled"] == ["NotImplementedError", "RuntimeError"]
        assert e["eager_global_variables"] == ["RuntimeError"]
        assert e["usable_after"] == [2.0, 2.0] and e["also_ours"] is True


def test_tf1_graph_runs_collectives_fetched_together_and_symbolic_splits(ranks):
    for r, res in enumerate(ranks):
        g = res["semantics"]["graph"]
        assert g["fused"] == [[2.0 * i + 1] * 3 for i in range(8)]
        assert g["mismatch"][0] == "FailedPreconditionError"
        assert g["alltoall"] == ([[0, 10, 11], [1, 2]] if r == 0 else [[1, 2, 12], [2, 1]])
        assert g["tf_function_alltoall"] == g["alltoall"]
        assert g["global_variables"] == [1.0, 1.0]  # rank 1's
        assert g["grad"] == [2.0, 2.0]


def test_every_collective_has_horovods_gradient(ranks):
    # loss = sum(output * [1, 2, ...]); x = [1, 2, 3, 4]; see hvd_tf_semantics.gradients
    want = [
        {"allgather": [1, 0, 0, 0], "broadcast": [0, 0, 0, 0], "alltoall": [1, 1, 2, 3]},
        {"allgather": [2, 3, 0, 0], "broadcast": [1, 2, 3, 4], "alltoall": [2, 3, 4, 5]},
    ]
    for r, res in enumerate(ranks):
        g = res["semantics"]["gradients"]
        assert g["allreduce_sum"] == g["grouped_allreduce"] == [2, 4, 6, 8]
        assert g["allreduce_avg"] == [1, 2, 3, 4]
        assert g["allgather"] == g["grouped_allgather"] == want[r]["allgather"]
        assert g["broadcast"] == want[r]["broadcast"] and g["alltoall"] == want[r]["alltoall"]
        assert g["reducescatter_sum"] == g["grouped_reducescatter"] == [2, 4, 2, 4]  # Horovod's: x size


def test_indexed_slices_are_gathered_or_reduced_dense(ranks):
    for res in ranks:
        s = res["semantics"]["sparse"]
        assert s["sum"] == [[[1.0, 1.0], [2.0, 2.0]], [0, 1]] and s["average"] == [[0.5, 0.5], [1.0, 1.0]]
        # d loss / d emb: row r = r + 1 on rank r; the mean over the ranks, gathered or dense
        dense = [[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]]
        assert s["tape_dense_False"] == ["IndexedSlices", dense] and s["tape_dense_True"] == [
            "EagerTensor",
            dense,
        ]


def test_local_sources_are_not_reduced_but_scaled(ranks):
    for r, res in enumerate(ranks):
        lo = res["semantics"]["local"]
        assert lo["plain"] == [[[r + 1.0]], [[r + 1.0]]]
        assert lo["tape"] == lo["optimizer"] == [[[(r + 1) / 2]], [[1.5]]] and lo["split"] == [1, 1]


def test_keras_local_variables_and_backward_passes_per_step(ranks):
    for r, res in enumerate(ranks):
        k = res["semantics"]["keras"]
        assert k["callback"] == [[float(r)], [float(r)], [1.0], [1.0]]  # layer 0 local, the rest rank 1's
        # grads averaged over the ranks 1.5, 2.5, 3.5, 4.5; applied every 2nd step, summed or averaged
        assert k["passes_average_False"] == [[0.0, 1], [-4.0, 0], [-4.0, 1], [-12.0, 0]]
        assert k["passes_average_True"] == [[0.0, 1], [-2.0, 0], [-2.0, 1], [-6.0, 0]]


def _params(path):
    with np.load(path) as z:
        return [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]


def test_tensorflow2_synthetic_benchmark_two_ranks_equal_one_on_the_full_batch(tmp_path):
    problem = venv_problem()
    if problem:
        pytest.skip(problem)
    script = str(ROOT / "examples" / "horovod" / "tensorflow2_synthetic_benchmark.py")
    args = ["--no-cuda", "--model", "tiny", "--image-size", "12", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "1", "--num-iters", "2"]  # fmt: skip
    run_tf([*HOROVODRUN, script, *args, "--batch-size", "4", "--save-params", "two.npz"], str(tmp_path))
    # the example's loss is per sample (tape.gradient sums it): the 2 ranks' mean of half-batch
    # sums is half the full batch's sum, so one process matches at half the learning rate
    run_tf(
        [PY, script, *args, "--batch-size", "8", "--lr", "0.005", "--save-params", "one.npz"], str(tmp_path)
    )
    two, one = _params(tmp_path / "two.npz"), _params(tmp_path / "one.npz")
    assert len(two) == len(one) == 4
    for a, b in zip(two, one):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_tensorflow2_keras_mnist_two_ranks_equal_one_on_the_full_batch(tmp_path):
    problem = venv_problem()
    if problem:
        pytest.skip(problem)
    script = str(ROOT / "examples" / "horovod" / "tensorflow2_keras_mnist.py")
    args = ["--epochs", "2", "--dropout", "0", "0", "--warmup-epochs", "0"]
    two_ranks = ["--steps", "4", "--batch-size", "8", "--save-params", "two.npz"]  # 2 steps a rank
    run_tf([*HOROVODRUN, script, *args, *two_ranks], str(tmp_path))
    # one process: the same 2 steps of whole batches (16) at the rate the example scales for 2 ranks
    one_rank = ["--steps", "2", "--batch-size", "16", "--base-lr", "0.002", "--save-params", "one.npz"]
    run_tf([PY, script, *args, *one_rank], str(tmp_path))
    two, one = _params(tmp_path / "two.npz"), _params(tmp_path / "one.npz")
    assert len(two) == len(one) == 8
    for a, b in zip(two, one):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # MetricAverageCallback: rank 0 logged the mean of both ranks' losses, the full batch's
    np.testing.assert_allclose(
        np.load(tmp_path / "two.npz.loss.npy"), np.load(tmp_path / "one.npz.loss.npy"), rtol=1e-5
    )
