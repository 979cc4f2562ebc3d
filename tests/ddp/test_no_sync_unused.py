"""no_sync() with find_unused_parameters over the real host backend (2 processes, raw arrays):
a grad accumulated in a no_sync() micro-step counts as used in the next synchronised step even
when that step gives it no grad, so its accumulated grad is reduced, as in PyTorch DDP."""

import numpy as np
import pytest
from mp import run_ranks

SHAPES = {
    "a": ((5, 3), np.float32),
    "b": ((7,), np.float32),
    "c": ((4,), np.float64),
    "d": ((3,), np.float32),
}
MODES = ["CppReducer", "PythonReducer"]


def grad(rank, micro, key):
    shape, dtype = SHAPES[key]
    rng = np.random.default_rng([rank, micro, list(SHAPES).index(key)])
    return rng.standard_normal(shape).astype(dtype)


def kept_d(rank):
    """Rank-specific grad of d, which no rank ever uses: never reduced, never changed."""
    return np.full(3, 10.0 + rank, np.float32)


def _accumulate_then_sync(rank, world):
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=60.0)
    out = {}
    try:
        for mode in MODES:
            params = {k: np.zeros(s, d) for k, (s, d) in SHAPES.items()}
            model = ArrayModule(params, forward=lambda p, x: x)
            ddp = nd.DistributedDataParallel(
                model, find_unused_parameters=True, reducer_mode=mode, bucket_cap_mb=64 / 2**20
            )  # several buckets
            model.grads["d"][...] = kept_d(rank)
            with ddp.no_sync():
                ddp(None)  # micro-step 0: a, b; c only on rank 0; finalized
                for k in ("a", "b") + (("c",) if rank == 0 else ()):
                    ddp.mark_ready(k, grad(rank, 0, k))
                ddp.finalize()
                ddp(None)  # micro-step 1: a only; left open (no finalize)
                ddp.mark_ready("a", grad(rank, 1, "a"))
            ddp(None)  # the synchronising step: a only
            ddp.mark_ready("a", grad(rank, 2, "a"))
            ddp.finalize()
            first = (
                {k: np.array(g) for k, g in model.grads.items()},
                sorted(ddp.reducer.used.unused_last_step),
            )
            ddp(None)  # next step: b, c no longer carry a no_sync grad
            ddp.mark_ready("a", grad(rank, 3, "a"))
            ddp.finalize()
            second = (
                {k: np.array(g) for k, g in model.grads.items()},
                sorted(ddp.reducer.used.unused_last_step),
            )
            ddp.close()
            out[mode] = first, second
    finally:
        nd.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_accumulate_then_sync, 2, timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_grad_from_no_sync_step_is_reduced(results, mode):
    acc = {
        r: {
            "a": sum(grad(r, m, "a") for m in range(3)),
            "b": grad(r, 0, "b"),
            "c": grad(r, 0, "c") if r == 0 else np.zeros(4, np.float64),
        }
        for r in (0, 1)
    }
    names = list(SHAPES)
    for rank, out in enumerate(results):
        (first, unused1), (second, unused2) = out[mode]
        for k in ("a", "b", "c"):  # the mean over ranks of the accumulated grads
            np.testing.assert_allclose(
                first[k], (acc[0][k] + acc[1][k]) / 2, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {k}"
            )
        np.testing.assert_array_equal(first["d"], kept_d(rank))
        assert unused1 == [names.index("d")]
        # the next step: a adds its new grad; b, c, d are unused everywhere and keep their grads
        assert unused2 == sorted(names.index(k) for k in ("b", "c", "d"))
        for k in ("b", "c", "d"):
            np.testing.assert_array_equal(second[k], first[k], err_msg=f"rank {rank} {k}")
        want_a = first["a"] + (grad(0, 3, "a") + grad(1, 3, "a")) / 2
        np.testing.assert_allclose(second["a"], want_a, rtol=1e-5, atol=1e-6)
