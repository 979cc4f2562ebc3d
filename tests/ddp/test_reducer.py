"""Reducer / DDP behaviour on N threads with an in-process group (fast; the multi-process versions
over the real host backend are in test_ddp_mp.py)."""

import time

import numpy as np
import pytest
from fakegroup import run_threads
from reducer_cases import FLAGS, SHAPES, expected_mean, local_grads, make_params, tol

from nccl_ddp import errors
from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.ddp.data_parallel import DistributedDataParallel

CAP_MB = 200 / 2**20  # 200 bytes: several buckets per dtype


def _flags_rank(group, flags, steps):
    avg, mode, static, unused = flags
    model = ArrayModule(make_params(seed=group.rank))  # init_sync makes them rank 0's
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        bucket_cap_mb=CAP_MB,
        average_in_collective=avg,
        reducer_mode=mode,
        static_graph=static,
        find_unused_parameters=unused,
    )
    out = []
    for step in range(steps):
        g = local_grads(group.rank, step)
        for k in reversed(list(g)):
            ddp.mark_ready(k, g[k])
        out.append({k: np.array(v, dtype=np.float64) for k, v in model.grads.items()})
        ddp.zero_grad()
    params = {k: np.array(v) for k, v in model.params.items()}
    return out, params, len(ddp.reducer.layout.buckets), ddp.reducer.mode


@pytest.mark.parametrize(
    "flags", FLAGS, ids=lambda f: f"avg{f[0]:d}-{f[1][:3]}-static{f[2]:d}-unused{f[3]:d}"
)
def test_reduced_grads_equal_numpy_mean(flags):
    size, steps = 3, 2
    res = run_threads(_flags_rank, size, flags, steps)
    rank0_params = make_params(seed=0)
    for out, params, nbuckets, mode in res:
        assert nbuckets >= 4
        assert mode == ("per_grad" if flags[1] == "PythonReducer" else "view")
        for k in params:
            np.testing.assert_array_equal(params[k], rank0_params[k])
        for step in range(steps):
            want = expected_mean(size, step)
            for k, (_, d) in zip(want, SHAPES):
                np.testing.assert_allclose(out[step][k], want[k], **tol(d), err_msg=k)


class NoViewModule(ArrayModule):
    """A module whose framework cannot alias grads to bucket views: the reducer packs/unpacks."""

    @property
    def can_install_grads(self):
        return False


def _pack_mode_rank(group):
    model = NoViewModule(make_params())
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=CAP_MB)
    g = local_grads(group.rank, 0)
    for k in reversed(list(g)):
        ddp.mark_ready(k, g[k])
    return ddp.reducer.mode, {k: np.array(v, np.float64) for k, v in model.grads.items()}


def test_pack_mode_gives_the_same_numbers():
    res = run_threads(_pack_mode_rank, 2)
    want = expected_mean(2, 0)
    for mode, grads in res:
        assert mode == "pack"
        for k, (_, d) in zip(want, SHAPES):
            np.testing.assert_allclose(grads[k], want[k], **tol(d))


def small_model(rank=0, n=4, size=8):
    rng = np.random.default_rng(rank)
    return ArrayModule({f"w{i}": rng.standard_normal(size).astype(np.float32) for i in range(n)})


def _unused_rank(group, mode):
    model = small_model()
    ddp = DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=0, find_unused_parameters=True, reducer_mode=mode
    )
    # w3 starts with a rank-specific value and is unused on every rank: left untouched.
    model.grads["w3"][...] = 10.0 + group.rank
    ddp.mark_ready("w2", np.full(8, 1.0 + group.rank, np.float32))
    if group.rank == 0:  # w1: used on rank 0 only -> reduced with zeros
        ddp.mark_ready("w1", np.full(8, 6.0, np.float32))
    ddp.mark_ready("w0", np.full(8, 2.0, np.float32))
    ddp.finalize()
    return {k: np.array(v) for k, v in model.grads.items()}


@pytest.mark.parametrize("mode", ["CppReducer", "PythonReducer"])
def test_find_unused_parameters(mode):
    res = run_threads(_unused_rank, 2, mode)
    for rank, g in enumerate(res):
        np.testing.assert_allclose(g["w2"], 1.5)
        np.testing.assert_allclose(g["w1"], 3.0)
        np.testing.assert_allclose(g["w0"], 2.0)
        np.testing.assert_allclose(g["w3"], 10.0 + rank)


def _missing_rank(group):
    model = small_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0)
    ddp.mark_ready("w3", np.ones(8, np.float32))
    ddp.mark_ready(2, np.ones(8, np.float32))
    with pytest.raises(errors.ReducerError) as e:
        ddp.finalize()
    return str(e.value)


def test_missing_grads_raise_naming_them():
    for msg in run_threads(_missing_rank, 2):
        assert "1 ('w1')" in msg and "0 ('w0')" in msg and "find_unused_parameters=True" in msg
        assert "w2" not in msg and "rank" in msg


def _twice_rank(group):
    ddp = DistributedDataParallel(small_model(), process_group=group)
    ddp.mark_ready(1, np.ones(8, np.float32))
    with pytest.raises(errors.ReducerError, match="only once.*1 \\('w1'\\)"):
        ddp.mark_ready("w1", np.ones(8, np.float32))


def test_marked_ready_twice_raises():
    run_threads(_twice_rank, 2)


def _rebuild_rank(group):
    model = ArrayModule({f"w{i}": np.zeros(64, np.float32) for i in range(6)})  # 256 B each
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=512 / 2**20)
    before = [b.params for b in ddp.reducer.layout.buckets]
    order = [0, 2, 4, 1, 3, 5] if group.rank == 0 else [5, 4, 3, 2, 1, 0]
    for i in order:
        ddp.mark_ready(i, np.full(64, float(i), np.float32))
    after = [b.params for b in ddp.reducer.layout.buckets]
    grads = [np.array(g) for g in ddp.grads]
    ddp.zero_grad()
    for i in order:  # step 2 runs on the rebuilt layout
        ddp.mark_ready(i, np.full(64, float(i + 1), np.float32))
    return before, after, grads, [np.array(g) for g in ddp.grads], model.grads["w0"] is ddp.grads[0]


def test_bucket_rebuild_uses_rank0_arrival_order():
    res = run_threads(_rebuild_rank, 2)
    for before, after, grads, grads2, aliased in res:
        assert before == [(5, 4), (3, 2), (1, 0)]  # 256 B first cap, then 512 B
        assert after == [(0, 2), (4, 1), (3, 5)]  # rank 0's order, on both ranks
        for i in range(6):
            np.testing.assert_array_equal(grads[i], float(i))
            np.testing.assert_array_equal(grads2[i], float(i + 1))
        assert aliased


def _overlap_rank(group):
    model = ArrayModule({f"w{i}": np.zeros(1024, np.float32) for i in range(4)})
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, init_sync=False)
    for i in (3, 2, 1):
        ddp.mark_ready(i, np.ones(1024, np.float32))
    deadline = time.monotonic() + 10
    while not group.started and time.monotonic() < deadline:  # bucket 0's all-reduce has begun
        time.sleep(0.001)
    started_before_last = [t for t, name, _ in group.started if name == "all_reduce"]
    t_last = time.monotonic()
    ddp.mark_ready(0, np.ones(1024, np.float32))
    return started_before_last, t_last


def test_allreduce_starts_before_the_last_grad_is_ready():
    for started, t_last in run_threads(_overlap_rank, 2):
        assert started and started[0] < t_last


def _where_buckets_reduce(group):
    """Step 2 (the fast path): every bucket but the last reduced on the comm thread while grads
    still arrive; the last one, with the comm stream idle, on the thread that waits for it."""
    import threading

    model = small_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0)
    threads = []
    reduce = group.all_reduce

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return reduce(*args, **kwargs)

    group.all_reduce = recording
    g = np.ones(8, np.float32)
    for _ in range(2):
        threads.clear()
        for i in (3, 2, 1):
            ddp.mark_ready(i, g)
        ddp.reducer.comm.synchronize(10)  # buckets 0-2 reduced: the comm stream is idle
        ddp.mark_ready(0, g)
    return threads, threading.current_thread().name, ddp.reducer.comm.name


def test_last_bucket_is_reduced_on_the_waiting_thread():
    for threads, mine, comm in run_threads(_where_buckets_reduce, 2):
        assert threads == [comm, comm, comm, mine], threads


def test_one_rank_reduces_every_bucket_on_the_calling_thread():
    """World 1: an identity all-reduce is not worth waking the comm thread for."""
    ((threads, mine, _),) = run_threads(_where_buckets_reduce, 1)
    assert threads == [mine] * 4, threads


def _no_sync_rank(group, use_no_sync):
    model = small_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0)
    g1, g2 = local_grads(group.rank, 0)["p3"][:8], local_grads(group.rank, 1)["p3"][:8]
    if use_no_sync:
        with ddp.no_sync():
            for i in range(4):
                ddp.mark_ready(i, g1)
        local = np.array(model.grads["w0"])
        for i in range(4):
            ddp.mark_ready(i, g2)
    else:
        local = g1
        for i in range(4):
            ddp.mark_ready(i, g1 + g2)  # one step over the concatenated batches
    return local, [np.array(g) for g in ddp.grads]


def test_no_sync_then_step_equals_one_big_step():
    a = run_threads(_no_sync_rank, 2, True)
    b = run_threads(_no_sync_rank, 2, False)
    for rank in range(2):
        np.testing.assert_allclose(a[rank][0], b[rank][0], rtol=1e-6)  # no comm inside no_sync
        for ga, gb in zip(a[rank][1], b[rank][1]):
            np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0][0], a[1][0])


def _accumulate_rank(group):
    model = small_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0)
    for step in range(2):
        for i in range(4):
            ddp.mark_ready(i, np.full(8, float(step + 1 + group.rank), np.float32))
    acc = np.array(model.grads["w0"])
    ddp.zero_grad()
    return acc, np.array(model.grads["w0"])


def test_grads_accumulate_until_zero_grad():
    for acc, zeroed in run_threads(_accumulate_rank, 2):
        np.testing.assert_allclose(acc, 1.5 + 2.5)
        np.testing.assert_array_equal(zeroed, 0.0)


def _static_rank(group):
    model = small_model()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, static_graph=True)
    for i in (3, 2, 0):
        ddp.mark_ready(i, np.ones(8, np.float32))
    ddp.finalize()  # w1 unused everywhere in step 1
    excluded = sorted(ddp.reducer.used.excluded)
    for i in (3, 2, 0):  # step 2 finalizes by itself without w1
        ddp.mark_ready(i, np.ones(8, np.float32))
    closed = not ddp.reducer.step.open
    with pytest.raises(errors.ReducerError, match="static_graph"):
        ddp.mark_ready(1, np.ones(8, np.float32))
    return excluded, closed, [b.params for b in ddp.reducer.layout.buckets]


def test_static_graph_drops_params_unused_in_step_one():
    for excluded, closed, layout in run_threads(_static_rank, 2):
        assert excluded == [1] and closed
        assert layout == [(3,), (2,), (0,)]


def _mismatch_rank(group):
    shape = (4, 3) if group.rank == 0 else (3, 4)
    model = ArrayModule({"a": np.zeros(5, np.float32), "b": np.zeros(shape, np.float32)})
    with pytest.raises(errors.RankMismatchError) as e:
        DistributedDataParallel(model, process_group=group)
    return str(e.value)


def test_init_sync_mismatch_raises_on_every_rank():
    msgs = run_threads(_mismatch_rank, 3)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"rank {rank}:")
        assert "parameter 1 ('b')" in msg and "rank 0 has shape (4, 3) float32" in msg
        assert "rank 1 has shape (3, 4) float32" in msg


def _wrong_state_rank(group):
    model = ArrayModule(make_params(), forward=lambda params, x: x * 2)
    ddp = DistributedDataParallel(model, process_group=group)
    assert ddp(3) == 6
    g = local_grads(group.rank, 0)
    ddp.mark_ready("p5", g["p5"])
    with pytest.raises(errors.ReducerError, match="zero_grad"):
        ddp.zero_grad()
    with pytest.raises(errors.ReducerError, match="prior iteration.*p0"):
        ddp(3)
    with pytest.raises(errors.ReducerError, match="unknown parameter 'nope'"):
        ddp.mark_ready("nope")
    with pytest.raises(errors.ReducerError, match="unknown parameter index 6"):
        ddp.mark_ready(6)
    with pytest.raises(errors.ReducerError, match="unknown parameter a ndarray"):
        ddp.mark_ready(np.zeros(3))
    for k in list(g)[:5]:
        ddp.mark_ready(k, g[k])  # completes the step
    with pytest.raises(errors.ReducerError, match="before the next forward"):
        ddp.mark_ready("p0", g["p0"])


def test_calls_in_the_wrong_state_raise():
    run_threads(_wrong_state_rank, 2)


def _hook_rank(group):
    model = small_model(n=2)
    ddp = DistributedDataParallel(model, process_group=group)
    hooks = ddp.grad_hooks()
    out = hooks[1](np.full(8, float(group.rank), np.float32))
    hooks[0](np.ones(8, np.float32))
    return np.array(out), out is model.grads["w1"]


def test_hooks_return_the_reduced_bucket_view():
    for out, aliased in run_threads(_hook_rank, 2):
        np.testing.assert_allclose(out, 0.5)
        assert aliased


BAD_ARGS = [
    (dict(init_sync=1), TypeError, "init_sync"),
    (dict(bucket_cap_mb="25"), TypeError, "bucket_cap_mb"),
    (dict(bucket_cap_mb=True), TypeError, "bucket_cap_mb"),
    (dict(bucket_cap_mb=-1), ValueError, "bucket_cap_mb"),
    (dict(find_unused_parameters=None), TypeError, "find_unused_parameters"),
    (dict(average_in_collective="yes"), TypeError, "average_in_collective"),
    (dict(static_graph=0), TypeError, "static_graph"),
    (dict(reducer_mode="cpp"), ValueError, "reducer_mode"),
    (dict(reducer_mode=None), ValueError, "reducer_mode"),
    (dict(process_group="world"), TypeError, "process_group"),
]


@pytest.mark.parametrize("kwargs,exc,name", BAD_ARGS, ids=[str(a[0]) for a in BAD_ARGS])
def test_bad_arguments_name_the_parameter(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        DistributedDataParallel(small_model(), **kwargs)


@pytest.mark.parametrize(
    "module,match",
    [
        (object(), "module must be"),
        ({"a": [1.0, 2.0]}, "must be an array .NumPy, CuPy"),
        ({"a": np.zeros((4, 4))[:, ::2]}, "C-contiguous"),
        ({"a": np.zeros(3, np.int32)}, "floating point"),
    ],
)
def test_bad_modules(module, match):
    with pytest.raises((TypeError, ValueError), match=match):
        DistributedDataParallel(module, process_group=_one_rank_group())


def _one_rank_group():
    from fakegroup import FakeGroup, _Shared

    return FakeGroup(_Shared(1, 5.0), 0, 1)


def _collective_count_rank(group, mode, unused):
    model = small_model(n=6)
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        bucket_cap_mb=64 / 2**20,
        reducer_mode=mode,
        find_unused_parameters=unused,
        init_sync=False,
    )
    order = [0, 3, 1, 4, 2, 5]
    for i in order:
        ddp.mark_ready(i, np.ones(8, np.float32))
    if unused:
        ddp.finalize()
    return (
        len(ddp.reducer.layout.buckets),
        sum(1 for _, name, _ in group.started if name == "all_reduce"),
        [b.params for b in ddp.reducer.layout.buckets],
    )


@pytest.mark.parametrize(
    "mode,unused", [("CppReducer", False), ("PythonReducer", False), ("CppReducer", True)]
)
def test_one_collective_per_bucket_or_per_grad(mode, unused):
    for nbuckets, n_allreduce, layout in run_threads(_collective_count_rank, 2, mode, unused):
        if mode == "PythonReducer":
            assert n_allreduce == 6  # one per grad
        elif unused:
            assert n_allreduce == nbuckets + 1  # + the used-parameter bitmap
            assert layout == [(5, 4), (3, 2), (1, 0)]  # find_unused: never rebuilt (PyTorch)
        else:
            assert n_allreduce == 3  # 32 B grads, 64 B buckets
            assert layout == [(0, 3), (1, 4), (2, 5)]  # rebuilt in arrival order


def _timeline_rank(group):
    from nccl_ddp.profiling import Timeline

    model = ArrayModule({f"w{i}": np.zeros(1 << 16, np.float32) for i in range(4)})
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, init_sync=False)
    ddp.reducer.prof = Timeline(group.rank, timeline=True)
    for i in (3, 2, 1):
        ddp.mark_ready(i, np.ones(1 << 16, np.float32))
    time.sleep(0.05)  # "backward" of the first layer
    ddp.mark_ready(0, np.ones(1 << 16, np.float32))
    return ddp.reducer.prof.steps[-1]


def test_timeline_sees_comm_inside_backward():
    for summary in run_threads(_timeline_rank, 2):
        assert summary.buckets == 4 and summary.nbytes == 4 * 4 * (1 << 16)
        assert summary.comm_s > 0 and summary.overlap_s > 0
        assert summary.overlap_s <= summary.comm_s + 1e-9


def _inline_timeline_rank(group):
    from nccl_ddp.profiling import Timeline

    model = ArrayModule({f"w{i}": np.zeros(1 << 16, np.float32) for i in range(4)})
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, init_sync=False)
    for _ in range(2):  # step 2 takes the fast path
        ddp.reducer.prof = Timeline(group.rank, timeline=True)
        for i in (3, 2, 1):
            ddp.mark_ready(i, np.ones(1 << 16, np.float32))
        ddp.reducer.comm.synchronize(10)  # idle: the last bucket runs inline
        ddp.mark_ready(0, np.ones(1 << 16, np.float32))
    return list(ddp.reducer.prof._spans)


def test_timeline_does_not_hide_the_bucket_run_after_backward():
    """The last bucket, run on the waiting thread (Stream.awaited), comes after the end of
    backward on the timeline: before, its span counted as hidden behind backward."""
    for spans in run_threads(_inline_timeline_rank, 2):
        backward = [s for s in spans if s.phase == "backward"]
        last = [s for s in spans if s.phase == "allreduce" and s.bucket == 3]
        assert len(backward) == 1 and len(last) == 1, spans
        assert last[0].start >= backward[0].end
