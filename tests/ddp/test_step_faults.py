"""Faults of a training step found by attacking the runtime (issue 13, 22, 30), each kept fixed by a
test that failed before: parameters in another order, check_finite on what the step hands back,
comm hooks that never finish or return the wrong thing, a jitted reduction failing on one rank.

Multi-process cases run on loopback with a hard bound (tests/support/mp.py); the slow variants are
marked `slow`.
"""

import os

import numpy as np
import pytest
from mp import outcome, run_ranks

import nccl_ddp as nd

f32 = np.float32


def _params_in_another_order(rank, world):
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=10)
    try:
        a, b = np.full(2, 1.0 + rank, f32), np.full(2, 100.0 + rank, f32)
        params = {"a": a, "b": b} if rank == 0 else {"b": b, "a": a}
        return outcome(lambda: nd.DistributedDataParallel(ArrayModule(params)).close())
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_ddp_same_shapes_in_another_order_names_both_parameters():
    # before: init_sync passed and rank 0's 'a' was averaged with rank 1's 'b'
    for rank, (kind, msg) in enumerate(run_ranks(_params_in_another_order, 2, timeout=60)):
        assert kind == "RankMismatchError", (rank, kind, msg)
        assert (
            "parameter 0: rank 0 has 'a' of shape (2,) float32, rank 1 has 'b' of shape (2,) float32" in msg
        ), msg


# -- check_finite sees what the step hands back (issue 22 item 1) ---------------------------------

# (name, param dtype, grad value on every rank, hook, state, mode, average_in_collective)
OVERFLOWS = [
    ("fp16 hook fused, view", "float32", 1e5, "fp16", None, "view", False),  # cast overflows
    ("fp16 hook fused, pack", "float32", 1e5, "fp16", None, "pack", False),
    ("fp16 hook in Python, view", "float32", 1e5, "fp16", "group", "view", False),
    ("fp16 hook in Python, pack", "float32", 1e5, "fp16", "group", "pack", False),
    ("fp16 AVG, view", "float16", 6e4, None, None, "view", True),  # wire sum
    ("fp16 AVG, pack", "float16", 6e4, None, None, "pack", True),
    ("float32 AVG, view", "float32", 3e38, None, None, "view", True),  # the AVG sum
    ("float32 AVG, pack", "float32", 3e38, None, None, "pack", True),
    ("float32 AVG, python", "float32", 3e38, None, None, "python", True),
    ("float32 AVG, user hook, view", "float32", 3e38, "avg", "group", "view", False),
    ("float32 AVG, user hook, pack", "float32", 3e38, "avg", "group", "pack", False),
]


def _avg_hook(group, bucket):
    """A user comm hook: the bucket averaged by the collective (its sum overflows)."""
    from nccl_ddp.comm.group import ReduceOp

    return group.all_reduce(bucket.buffer(), ReduceOp.AVG)


# (name, grad value, compress, mean): the grad reducer's sum without a mean overflows float32
REDUCER_OVERFLOWS = [("grad reducer sum", 3e38, None, False), ("grad reducer fp16", 1e5, "fp16", True)]


def _overflowing_steps(rank, world, transport, check):
    from counting_group import PackOnly

    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import NonFiniteGradError

    os.environ["NCCL_DDP_HOST_TRANSPORT"] = transport
    nd.init_process_group("host", timeout=30)
    out = {}
    try:
        for name, dtype, value, hook, state, mode, avg in OVERFLOWS:
            params = {"w": np.zeros(8, dtype), "b": np.zeros(3, dtype)}
            module = PackOnly(params) if mode == "pack" else ArrayModule(params)
            ddp = nd.DistributedDataParallel(
                module,
                check_finite=check,
                average_in_collective=avg,
                reducer_mode="PythonReducer" if mode == "python" else "CppReducer",
            )
            if hook:
                ddp.register_comm_hook(
                    nd.new_group(list(range(world))) if state else None,
                    _avg_hook if hook == "avg" else getattr(hooks, f"{hook}_compress"),
                )
            finite, error = _one_step(
                ddp,
                lambda: [
                    ddp.mark_ready(n, np.full(p.shape, value, dtype)) for n, p in reversed(params.items())
                ],
                NonFiniteGradError,
            )
            out[name] = (finite, error, _all_finite(ddp.grads))
        for name, value, compress, mean in REDUCER_OVERFLOWS:
            red = nd.DistributedGradReducer(
                [np.zeros(8, np.float32), np.zeros(3, np.float32)],
                mean=mean,
                compress=compress,
                check_finite=check,
            )
            got: list = []
            finite, error = _one_step(
                red,
                lambda: got.extend(red([np.full(8, value, np.float32), np.full(3, value, np.float32)])),
                NonFiniteGradError,
            )
            out[name] = (finite, error, _all_finite(got) if got else None)
        return out
    finally:
        nd.destroy_process_group()


def _one_step(owner, step, error_type):
    try:
        step()
        error = None
    except error_type as e:
        error = str(e)
    return owner.last_step_finite, error


def _all_finite(arrays):
    return all(bool(np.isfinite(np.asarray(a, np.float64)).all()) for a in arrays)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_check_finite_sees_overflow_in_cast_reduction_and_unpack(transport):
    # before: each of these handed back inf with last_step_finite=True (the flag only looked
    # at each rank's grads as they were packed)
    results = run_ranks(_overflowing_steps, 2, transport, True, timeout=120)
    for rank, res in enumerate(results):
        for name, (finite, error, grads_finite) in res.items():
            # the flag says exactly whether what came back is finite (an fp16 AVG sum overflows
            # on the TCP ring, whose partial sums are fp16, not in shm's float32 accumulator)
            assert finite is grads_finite and error is None, (rank, name, finite, grads_finite)
            if "fp16 AVG" not in name:
                assert grads_finite is False, (rank, name, "the case must overflow")
    assert results[0] == results[1]  # every rank agrees


@pytest.mark.slow
def test_check_finite_raise_on_an_overflowing_reduction():
    results = run_ranks(_overflowing_steps, 2, "shm", "raise", timeout=120)
    for rank, res in enumerate(results):
        for name, (finite, error, _) in res.items():
            if "fp16 AVG" in name:  # finite on shm (see above)
                continue
            assert finite is False, (rank, name)
            assert error and error.startswith(f"rank {rank}: step 0 produced non-finite grads"), (
                rank,
                name,
                error,
            )


@pytest.mark.slow  # the CPU build of the kernels, when it is the first test to need it
@pytest.mark.parametrize("views", [True, False])
def test_check_finite_on_the_cuda_path_sees_an_overflowing_reduction(monkeypatch, views):
    """The CUDA device on the fake CuPy (kernels run on the CPU simulator), with a group whose
    all-reduce sums two equal ranks without dividing (an AVG that overflows). View mode: the
    checked unpack in place over the bucket; pack mode: the unpack that writes the grads."""
    import collections
    import sys

    import _fake_cupy
    from _fake_cupy import FakeCupy
    from counting_group import CountingGroup, Done

    from nccl_ddp import device as D
    from nccl_ddp.ddp.config import DDPConfig
    from nccl_ddp.ddp.reducer import Reducer
    from nccl_ddp.kernels import cuda as ck

    if _fake_cupy.cpu_kernels() is None:
        pytest.skip(_fake_cupy.CPU_KERNELS_MISSING)

    class Doubling(CountingGroup):
        def all_reduce(self, buf, op=None, stream=None, *, tag=None):
            if np.dtype(buf.dtype).kind == "f":
                h = buf.host()
                h[...] = h + h
            return Done()

    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    record = _fake_cupy.FakeEvent.record

    def record_done(ev, stream=None):
        out = record(ev, stream)
        ev.done = True
        return out

    monkeypatch.setattr(_fake_cupy.FakeEvent, "record", record_done)
    sizes = [12, 5]
    params = [cp.asarray(np.ones(n, np.float32)) for n in sizes]
    grads = [cp.zeros(n, dtype=np.float32) for n in sizes]
    r = Reducer(
        params,
        grads,
        Doubling(collections.Counter()),
        D.CudaDevice(0),
        DDPConfig(check_finite=True, average_in_collective=True),
        install=(lambda i, view: None) if views else None,
    )
    assert r.mode == ("view" if views else "pack")
    for step, value in enumerate((1e38, 3e38)):  # 2e38 fits float32, 6e38 does not
        for i in reversed(range(2)):
            r.grads[i].host()[...] = np.float32(value)
            r.mark_ready(i)
        back = np.concatenate([g.get().reshape(-1) for g in r.grads])
        assert bool(np.isfinite(back).all()) is (step == 0)
        assert r.last_step_finite is (step == 0)  # before: True at step 1, inf handed back
        r.zero_grad()


# -- comm hooks that never finish or return the wrong thing (issue 30, items 1 and 4) ------------


def _torch_hook_steps(rank, world, kind):
    """Two steps of a torch DDP whose hook misbehaves (`kind`); what each step raised."""
    import torch

    def never(state, bucket):  # a future nobody ever completes
        return torch.futures.Future()

    def one_too_many(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.cat([bucket.buffer(), bucket.buffer()[:1]]))
        return fut

    def two_tensors(state, bucket):
        fut = torch.futures.Future()
        fut.set_result([bucket.buffer(), bucket.buffer()])
        return fut

    hook = {"never": never, "one_too_many": one_too_many, "two_tensors": two_tensors}[kind]
    nd.init_process_group("host", timeout=2.0)
    try:
        torch.manual_seed(0)
        ddp = nd.DistributedDataParallel(torch.nn.Linear(12, 15))  # 180 + 15 grads, 196 with padding
        ddp.register_comm_hook(None, hook)
        seen = []
        for _ in range(2):
            seen.append(outcome(lambda: ddp(torch.ones(3, 12)).sum().backward()))
        return seen
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_torch_hook_future_that_never_completes_times_out_naming_hook_and_bucket():
    """torch's Future.wait() takes no timeout: before, a hook's future that nobody completes hung
    the step for ever (run_ranks' 60 s bound killed it). Now the wait is bounded by the group's
    timeout (2 s here) and names the hook and the bucket; the next step says the first failed."""
    (first, second), *_ = run_ranks(_torch_hook_steps, 2, "never", timeout=60)
    assert first[0] == "CommTimeout", first
    assert "comm hook never: the future it returned for bucket 0 did not complete within 2s" in first[1]
    assert second[0] == "ReducerError" and "a previous step failed (CommTimeout" in second[1], second


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, want",
    [
        (
            "one_too_many",
            "comm hook one_too_many returned a (197,) torch.float32 tensor for bucket 0, "
            "which holds 196 torch.float32 elements",
        ),
        ("two_tensors", "comm hook two_tensors returned a future of a list of 2 Tensor for bucket 0"),
    ],
)
def test_torch_hook_wrong_result_is_named_and_the_next_step_says_so(kind, want):
    """Before: the wrong size was named once, then every later step said "Expected to have
    finished reduction in the prior iteration ... parameters that were not used" (a wrong cause);
    a list of two tensors failed with "'list' object has no attribute 'data_ptr'"."""
    for first, second in run_ranks(_torch_hook_steps, 2, kind, timeout=60):
        assert first[0] == "CommHookError" and want in first[1], first
        assert second[0] == "ReducerError", second
        assert "a previous step failed (CommHookError: rank" in second[1] and want in second[1], second
        assert "prior iteration" not in second[1]


def _array_hook_steps(rank, world):
    from nccl_ddp.adapters.arrays import ArrayModule

    def two_arrays(state, bucket):
        return nd.hooks.Future.completed([bucket.buffer(), bucket.buffer()])

    nd.init_process_group("host", rank=0, world_size=1)
    try:
        ddp = nd.DistributedDataParallel(ArrayModule([np.zeros(4, f32)]))
        ddp.register_comm_hook(None, two_arrays)
        return [outcome(lambda: ddp.mark_ready(0, np.ones(4, f32))) for _ in range(2)]
    finally:
        nd.destroy_process_group()


def test_array_hook_returning_a_list_is_named_and_the_next_step_says_so():
    """A NumPy hook whose future holds a list: before, "'list' object has no attribute 'shape'"."""
    first, second = _array_hook_steps(0, 1)
    assert first[0] == "CommHookError", first
    assert "comm hook 'two_arrays' returned a future of a list of 2 ndarray for bucket 0" in first[1]
    assert second[0] == "ReducerError" and "a previous step failed (CommHookError" in second[1], second


def _jit_step_fails_on_rank0(rank, world):
    import jax
    import jax.numpy as jnp

    nd.init_process_group("host", timeout=10)
    try:
        params = {"b": jnp.zeros(2, jnp.float32), "w": jnp.ones(4, jnp.float32)}
        reducer = nd.DistributedGradReducer(params)
        step = jax.jit(lambda grads: reducer(grads))
        reduce = reducer._reduce

        def injected(*args):  # the fault: rank 0's reduction of step 1 raises
            raise RuntimeError("injected failure in rank 0's reduction")

        seen = []
        for s in range(3):
            reducer._reduce = injected if (rank, s) == (0, 1) else reduce
            grads = {"b": jnp.full(2, rank + s, jnp.float32), "w": jnp.full(4, rank + s, jnp.float32)}
            seen.append(outcome(lambda: np.asarray(jax.block_until_ready(step(grads))["b"]).tolist()))
        seen.append(outcome(lambda: nd.all_reduce(np.ones(2, f32)).tolist()))
        return seen
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_jit_reduction_failing_on_one_rank_poisons_the_group():
    """Inside jax.jit the reducer is an io_callback; when it raises on rank 0 and the caller
    catches it and goes on, every later reduction and collective on every rank raises naming that
    failure. Before: rank 1's reduction of that step waited for the whole timeout and named no
    cause (and a rank whose later collectives went on paired them with another step's)."""
    why = "injected failure in rank 0's reduction"
    r0, r1 = run_ranks(_jit_step_fails_on_rank0, 2, timeout=120)
    assert r0[0] == r1[0] == ("ok", [0.5, 0.5]), (r0, r1)
    assert why in r0[1][1], r0
    assert "rank 0: a step of DistributedGradReducer failed on this rank (RuntimeError: " + why in r1[1][1], (
        r1
    )
    for kind, msg in r0[2:] + r1[2:]:
        assert kind != "ok" and why in msg, (r0, r1)
