"""Cross-rank checks at construction, on 2 host processes: DistributedGradReducer's parameters and
options, DistributedDataParallel's settings (init_sync). A mismatch raises RankMismatchError on
every rank naming the difference; the group stays usable."""

import numpy as np
import pytest
from mp import run_ranks

f32 = np.float32

# (DDP keyword, rank 0's value, rank 1's value, how each side is shown in the message)
DDP_SETTINGS = [
    ("find_unused_parameters", False, True, ("False", "True")),
    ("average_in_collective", True, False, ("True", "False")),
    ("reducer_mode", "CppReducer", "PythonReducer", ("'CppReducer'", "'PythonReducer'")),
    ("static_graph", False, True, ("False", "True")),
    ("bucket_cap_mb", None, 1, ("25.0", "1.0")),
]


def _error_of(fn):
    """The RankMismatchError's message, or what happened instead (the test shows it)."""
    import nccl_ddp as nd

    try:
        fn()
    except nd.errors.RankMismatchError as e:
        return str(e)
    except Exception as e:  # shown by the test's assertion
        return f"unexpected {type(e).__name__}: {e}"
    return "no error"


def _checks(rank, world):
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=20.0)
    out = {}
    try:
        # grad reducer: 3 vs 4 elements would fit one padded bucket and reduce to wrong numbers
        params = [np.zeros(5, f32), np.zeros(3 + rank, f32)]
        out["shape"] = _error_of(lambda: nd.DistributedGradReducer(params))
        out["count"] = _error_of(lambda: nd.DistributedGradReducer([np.zeros(4, f32)] * (1 + rank)))
        ps = [np.zeros(4, f32)] * 3
        out["mean"] = _error_of(lambda: nd.DistributedGradReducer(ps, mean=rank == 0))
        out["degree"] = _error_of(lambda: nd.DistributedGradReducer(ps, degree=2 + rank))
        out["fusion"] = _error_of(lambda: nd.DistributedGradReducer(ps, fusion_type=rank))
        for name, a, b, _ in DDP_SETTINGS:
            model = ArrayModule({"w": np.zeros(4, f32), "b": np.zeros(2, f32)})
            out[name] = _error_of(lambda: nd.DistributedDataParallel(model, **{name: a if rank == 0 else b}))
        # init_sync=False skips the check (documented): construction succeeds
        model = ArrayModule({"w": np.zeros(4, f32)})
        nd.DistributedDataParallel(model, init_sync=False, static_graph=rank == 1).close()
        # the group still works: matching reducers reduce
        red = nd.DistributedGradReducer(ps, mean=True)
        got = [o.tolist() for o in red([np.full(4, rank + 1.0, f32)] * 3)]
        red.close()
        model = ArrayModule({"w": np.zeros(4, f32)})
        ddp = nd.DistributedDataParallel(model, find_unused_parameters=True)
        ddp.mark_ready("w", np.full(4, 2.0 * rank, f32))
        ddp.close()
        got.append(model.grads["w"].tolist())
    finally:
        nd.destroy_process_group()
    return out, got


@pytest.mark.slow
def test_mismatches_raise_on_every_rank_naming_the_difference():
    results = run_ranks(_checks, 2, timeout=90)
    for rank, (out, got) in enumerate(results):

        def has(key, *parts):
            msg = out[key]
            assert msg.startswith(f"rank {rank}: "), msg
            missing = [p for p in parts if p not in msg]
            assert not missing, f"{key}: {missing} not in: {msg}"

        has("shape", "parameter 1: rank 0 has shape (3,) float32, rank 1 has shape (4,) float32")
        has("count", "parameter 1: rank 0 has no such parameter (only 1), rank 1 has shape (4,)")
        has("mean", "DistributedGradReducer", "mean: rank 0 has True, rank 1 has False")
        has("degree", "degree: rank 0 has 2, rank 1 has 3")
        has("fusion", "fusion id (fusion_type or comm_fusion) of parameter 0: rank 0 has 0, rank 1 has 1")
        for name, _, _, (a, b) in DDP_SETTINGS:
            has(
                name,
                "DistributedDataParallel",
                f"{name}: rank 0 has {a}, rank {1} has {b}",
                f"Every rank must pass the same {name}",
            )
        assert got == [[1.5] * 4] * 3 + [[1.0] * 4], got
