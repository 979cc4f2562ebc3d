"""DistributedDataParallel / DistributedGradReducer over the real host backend, 2 and 3 processes."""

import time

import numpy as np
import pytest
from mp import run_ranks
from reducer_cases import FLAGS, SHAPES, expected_mean, local_grads, make_params, tol


def _init():
    import nccl_ddp as nd

    nd.init_process_group("host", timeout=60.0)
    return nd


def _flags_matrix(rank, world, steps):
    nd = _init()
    from nccl_ddp.adapters.arrays import ArrayModule

    out = {}
    try:
        for flags in FLAGS:
            avg, mode, static, unused = flags
            model = ArrayModule(make_params(seed=rank))
            ddp = nd.DistributedDataParallel(
                model,
                bucket_cap_mb=200 / 2**20,
                average_in_collective=avg,
                reducer_mode=mode,
                static_graph=static,
                find_unused_parameters=unused,
            )
            res = []
            for step in range(steps):
                g = local_grads(rank, step)
                for k in reversed(list(g)):
                    ddp.mark_ready(k, g[k])
                res.append({k: np.array(v, np.float64) for k, v in model.grads.items()})
                ddp.zero_grad()
            ddp.close()
            out[flags] = (res, {k: np.array(v) for k, v in model.params.items()})
    finally:
        nd.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_flag_matrix_matches_numpy_mean(world):
    steps = 2
    results = run_ranks(_flags_matrix, world, steps, timeout=120)
    want = [expected_mean(world, s) for s in range(steps)]
    p0 = make_params(seed=0)
    for out in results:
        for flags, (res, params) in out.items():
            for k in params:
                np.testing.assert_array_equal(params[k], p0[k])
            for s in range(steps):
                for k, (_, d) in zip(want[s], SHAPES):
                    np.testing.assert_allclose(
                        res[s][k], want[s][k], **tol(d), err_msg=f"{flags} step {s} {k}"
                    )


def _mismatch(rank, world):
    nd = _init()
    from nccl_ddp.adapters.arrays import ArrayModule

    params = {"a": np.zeros(5, np.float32), "b": np.zeros(4, np.float32)}
    if rank == 2:
        params["b"] = np.zeros(4, np.float64)
    try:
        nd.DistributedDataParallel(ArrayModule(params))
    except nd.errors.RankMismatchError as e:
        return str(e)
    finally:
        nd.destroy_process_group()
    return None


@pytest.mark.slow
def test_init_sync_mismatch_raises_on_every_rank():
    msgs = run_ranks(_mismatch, 3, timeout=60)
    for rank, msg in enumerate(msgs):
        assert msg is not None and msg.startswith(f"rank {rank}:")
        assert "parameter 1 ('b')" in msg and "rank 0 has shape (4,) float32" in msg
        assert "rank 2 has shape (4,) float64" in msg


def _overlap(rank, world):
    nd = _init()
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.comm.group import ProcessGroup

    class Recording(ProcessGroup):
        """Delegates to the world group; notes when the comm stream reaches each all-reduce."""

        def __init__(self, inner):
            self.inner, self.started = inner, []
            for a in ("backend", "rank", "size", "ranks", "timeout", "name"):
                setattr(self, a, getattr(inner, a))

        def all_reduce(self, buf, op="sum", stream=None, *, tag=None):
            self.started.append(time.monotonic())
            return self.inner.all_reduce(buf, op, stream, tag=tag)

        def broadcast(self, *a, **k):
            return self.inner.broadcast(*a, **k)

        def all_gather(self, *a, **k):
            return self.inner.all_gather(*a, **k)

        def reduce_scatter(self, *a, **k):
            return self.inner.reduce_scatter(*a, **k)

        def barrier(self, *a, **k):
            return self.inner.barrier(*a, **k)

        def new_subgroup(self, ranks):
            return self.inner.new_subgroup(ranks)

        def shutdown(self):
            pass

    group = Recording(nd.get_world_group())
    try:
        model = ArrayModule({f"w{i}": np.zeros(4096, np.float32) for i in range(4)})
        ddp = nd.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, init_sync=False)
        for i in (3, 2, 1):
            ddp.mark_ready(i, np.ones(4096, np.float32))
        deadline = time.monotonic() + 20
        while not group.started and time.monotonic() < deadline:
            time.sleep(0.001)
        before = list(group.started)
        t_last = time.monotonic()
        ddp.mark_ready(0, np.ones(4096, np.float32))
        reduced = np.array(model.grads["w3"])
        ddp.close()
    finally:
        nd.destroy_process_group()
    return before, t_last, reduced


@pytest.mark.slow
def test_allreduce_starts_while_backward_is_still_marking():
    for before, t_last, reduced in run_ranks(_overlap, 2, timeout=60):
        assert before and before[0] < t_last
        np.testing.assert_array_equal(reduced, 1.0)


def _subgroup(rank, world):
    nd = _init()
    from nccl_ddp.adapters.arrays import ArrayModule

    try:
        group = nd.new_group([0, 2])
        if not group:
            return None
        model = ArrayModule({"w": np.zeros(6, np.float32)})
        ddp = nd.DistributedDataParallel(model, process_group=group)
        ddp.mark_ready("w", np.full(6, float(rank), np.float32))
        red = nd.DistributedGradReducer([model.params["w"]], group=group)
        out = red([np.full(6, float(rank), np.float32)])
        return np.array(model.grads["w"]), np.array(out[0])
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_process_group_from_new_group():
    res = run_ranks(_subgroup, 3, timeout=60)
    assert res[1] is None
    for r in (0, 2):
        np.testing.assert_allclose(res[r][0], 1.0)
        np.testing.assert_allclose(res[r][1], 1.0)


def _bfloat16(rank, world):
    import ml_dtypes

    nd = _init()
    from nccl_ddp.adapters.arrays import ArrayModule

    bf16 = np.dtype(ml_dtypes.bfloat16)
    try:
        out = []
        for mode in ("CppReducer", "PythonReducer"):
            model = ArrayModule({"a": np.zeros(37, bf16), "b": np.zeros(5, np.float32)})
            ddp = nd.DistributedDataParallel(model, bucket_cap_mb=0, reducer_mode=mode)
            ddp.mark_ready("b", np.full(5, rank, np.float32))
            ddp.mark_ready("a", np.full(37, 1.5 * (rank + 1), bf16))
            out.append((model.grads["a"].astype(np.float32), model.grads["a"].dtype == bf16))
            ddp.close()
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_bfloat16_grads():
    for out in run_ranks(_bfloat16, 2, timeout=60):
        for grads, is_bf16 in out:
            assert is_bf16
            np.testing.assert_allclose(grads, 2.25, rtol=1e-2)
