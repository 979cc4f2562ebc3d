"""nccl_ddp.horovod.torch on 2 ranks: each collective's keywords against NumPy, bad inputs named,
and DistributedOptimizer against a single process on the full batch (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import error_of, run_ranks  # noqa: E402

WORLD = 2


def _collectives(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    hvd.init()
    out: dict = {
        "ids": (
            hvd.rank(),
            hvd.size(),
            hvd.local_rank(),
            hvd.local_size(),
            hvd.cross_rank(),
            hvd.cross_size(),
        )
    }
    t = torch.arange(4, dtype=torch.float32) + rank  # rank 0: 0 1 2 3; rank 1: 1 2 3 4
    out["average"] = hvd.allreduce(t).tolist()
    out["average_flag"] = hvd.allreduce(t, average=False).tolist()
    for name in ("Sum", "Min", "Max", "Product"):
        out[name] = hvd.allreduce(t, op=getattr(hvd, name)).tolist()
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    out["fp16"] = (lambda r: (r.dtype, r.tolist()))(hvd.allreduce(t / 3, compression=hvd.Compression.fp16))
    out["input_kept"] = t.tolist()
    inplace = t.clone()
    same = hvd.allreduce_(inplace, op=hvd.Sum)
    out["inplace"] = (same is inplace, inplace.tolist())
    h = hvd.allreduce_async(t, op=hvd.Sum)
    out["async"] = hvd.synchronize(h).tolist()
    out["poll_after"] = error_of(lambda: hvd.poll(h))
    a, b = torch.ones(3) * (rank + 1), torch.ones(2, dtype=torch.float64) * (rank + 1)
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([a, b], op=hvd.Sum)]
    x = torch.ones(2, 2, requires_grad=True)
    hvd.allreduce(x * (rank + 1), op=hvd.Sum).sum().backward()
    out["allreduce_grad"] = x.grad.tolist()
    out["allgather"] = hvd.allgather(torch.full((rank + 1, 2), float(rank))).tolist()
    out["grouped_gather_scatter"] = (
        [g.tolist() for g in hvd.grouped_allgather([t[:1], t[:2]])],
        [g.tolist() for g in hvd.grouped_reducescatter([t, t[:2]], op=hvd.Sum)],
    )
    out["broadcast"] = hvd.broadcast(t, root_rank=1).tolist()
    bt = t.clone()
    hvd.broadcast_(bt, root_rank=0)
    out["broadcast_"] = bt.tolist()
    rows = torch.arange(10, dtype=torch.float32).reshape(5, 2) * (rank + 1)
    out["reducescatter"] = hvd.reducescatter(rows).tolist()
    out["reducescatter_sum"] = hvd.reducescatter(rows, op=hvd.Sum).tolist()
    got, received = hvd.alltoall(torch.arange(3.0) + 10 * rank, splits=[1, 2] if rank == 0 else [2, 1])
    out["alltoall"] = (got.tolist(), received.tolist())
    out["alltoall_even"] = hvd.alltoall(torch.arange(4.0) + 10 * rank).tolist()
    out["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    out["allgather_object"] = hvd.allgather_object(("r", rank))
    hvd.barrier()
    alone = hvd.add_process_set([0])
    out["set"] = (alone.size(), alone.rank(), alone.included())
    if rank == 0:
        out["set_sum"] = hvd.allreduce(t, op=hvd.Sum, process_set=alone).tolist()
    else:
        out["set_refused"] = error_of(lambda: hvd.allreduce(t, process_set=alone))
    out["join"] = hvd.join()
    # bad inputs: named, on every rank
    out["adasum"] = error_of(lambda: hvd.allreduce(t, op=hvd.Adasum))
    out["unknown_op"] = error_of(lambda: hvd.allreduce(t, op=17))
    out["bad_scale"] = error_of(lambda: hvd.allreduce(t, prescale_factor="2"))
    out["int_scale"] = hvd.allreduce(
        torch.ones(2, dtype=torch.int32), op=hvd.Sum, prescale_factor=2.5
    ).tolist()
    out["splits"] = error_of(lambda: hvd.alltoall(torch.arange(3.0), splits=[1, 1]))
    out["mismatch"] = error_of(lambda: hvd.allgather(torch.ones(2, 3 + rank)))
    out["after_mismatch"] = hvd.allreduce(t, op=hvd.Sum).tolist()  # the group still works
    hvd.shutdown()
    out["after_shutdown"] = error_of(hvd.rank)
    return out


@pytest.fixture(scope="module")
def collectives():
    return run_ranks(_collectives, WORLD, timeout=120)


@pytest.mark.slow
def test_ranks_and_allreduce_keywords(collectives):
    r0, r1 = collectives
    assert r0["ids"] == (0, 2, 0, 2, 0, 1) and r1["ids"] == (1, 2, 1, 2, 0, 1)
    t0, t1 = np.arange(4.0), np.arange(4.0) + 1
    for r in collectives:
        assert r["average"] == ((t0 + t1) / 2).tolist()
        assert r["average_flag"] == (t0 + t1).tolist()
        assert r["Sum"] == (t0 + t1).tolist()
        assert r["Min"] == t0.tolist() and r["Max"] == t1.tolist()
        assert r["Product"] == (t0 * t1).tolist()
        assert r["scaled"] == ((2 * t0 + 2 * t1) * 0.5).tolist()
        dtype, values = r["fp16"]
        assert dtype == torch.float32
        expect = (t0.astype(np.float32) / 3).astype(np.float16) + (t1.astype(np.float32) / 3).astype(
            np.float16
        )
        assert np.allclose(values, expect.astype(np.float32) / 2, rtol=1e-3)
        assert r["async"] == (t0 + t1).tolist()
        assert r["grouped"] == [[3.0] * 3, [3.0] * 2]
    assert r0["input_kept"] == t0.tolist() and r1["input_kept"] == t1.tolist()
    assert r0["inplace"] == (True, (t0 + t1).tolist())
    # backward of a Sum allreduce: the Sum allreduce of the ones (2), times this rank's factor
    assert r0["allreduce_grad"] == [[2.0, 2.0]] * 2 and r1["allreduce_grad"] == [[4.0, 4.0]] * 2
    assert "unknown handle" in r0["poll_after"]


@pytest.mark.slow
def test_gather_broadcast_scatter_alltoall_objects(collectives):
    r0, r1 = collectives
    rows = np.arange(10.0).reshape(5, 2)
    for r in collectives:
        assert r["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # rank 0's 1 row, rank 1's 2
        assert r["broadcast"] == (np.arange(4.0) + 1).tolist()
        assert r["broadcast_"] == np.arange(4.0).tolist()
        assert r["broadcast_object"] == {"from": 1}
        assert r["allgather_object"] == [("r", 0), ("r", 1)]
    # 5 rows over 2 ranks: rank 0 gets 3, rank 1 gets 2 (Horovod's split); Average divides by 2
    assert (
        r0["reducescatter"] == (rows[:3] * 3 / 2).tolist()
        and r1["reducescatter"] == (rows[3:] * 3 / 2).tolist()
    )
    assert r0["reducescatter_sum"] == (rows[:3] * 3).tolist()
    assert r0["alltoall"] == ([0.0, 10.0, 11.0], [1, 2]) and r1["alltoall"] == ([1.0, 2.0, 12.0], [2, 1])
    assert r0["alltoall_even"] == [0.0, 1.0, 10.0, 11.0] and r1["alltoall_even"] == [2.0, 3.0, 12.0, 13.0]
    assert r0["set"] == (1, 0, True) and r1["set"] == (1, None, False)
    assert r0["set_sum"] == np.arange(4.0).tolist()
    assert "rank 1" in r1["set_refused"] and "not in process set [0]" in r1["set_refused"]
    assert r0["join"] == r1["join"] == 1
    # grouped_allgather / grouped_reducescatter: each tensor as its own collective
    assert r0["grouped_gather_scatter"] == ([[0.0, 1.0], [0.0, 1.0, 1.0, 2.0]], [[1.0, 3.0], [1.0]])
    assert r1["grouped_gather_scatter"] == ([[0.0, 1.0], [0.0, 1.0, 1.0, 2.0]], [[5.0, 7.0], [3.0]])


@pytest.mark.slow
def test_bad_inputs_are_named(collectives):
    for r in collectives:
        assert r["adasum"].startswith("ConfigError") and "op=hvd.Adasum is not supported" in r["adasum"]
        assert "unknown op 17" in r["unknown_op"]
        assert "prescale_factor must be a number" in r["bad_scale"]
        assert r["int_scale"] == [4, 4]  # Horovod's: each rank's 1 * 2.5 rounded toward zero, summed
        assert "splits [1, 1] must hold 2 non-negative row counts" in r["splits"]
        assert (
            r["mismatch"].startswith("RankMismatchError")
            and "Mismatched allgather tensor shapes: One rank sent a tensor with dimension 1 equal to 3"
            in r["mismatch"]
            and 'float32[2, 3]", 1: "allgather' in r["mismatch"]
            and "float32[2, 4]" in r["mismatch"]
        )
        assert r["after_mismatch"] == [1.0, 3.0, 5.0, 7.0]
        assert "call hvd.init() first" in r["after_shutdown"]


# ---------------------------------------------------------------------------------------------
# DistributedOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


CASES = {
    "average": dict(),
    "fp16": dict(compression="fp16"),
    "sum": dict(op="Sum", lr_factor=0.5),  # the sum of 2 half-batch means is twice the mean
    "predivide": dict(gradient_predivide_factor=2.0),
    "passes2": dict(backward_passes_per_step=2),
    "sync-clip-skip": dict(clip=0.05),
}


def _train(model, opt, x, y, steps, passes=1, clip=None, hvd=None):
    for _ in range(steps):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            (torch.nn.functional.mse_loss(model(xs), ys) / passes).backward()
        if clip is None:
            opt.step()
            continue
        if hvd is not None:
            opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if hvd is None:
            opt.step()
        else:
            with opt.skip_synchronize():
                opt.step()


def _optimizer(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    x, y = _data()
    mine = slice(rank * 8, rank * 8 + 8)
    out = {}
    for name, case in CASES.items():
        lr = 0.1 * case.get("lr_factor", 1.0)
        oracle = _model()
        _train(
            oracle, torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9), x, y, 3, clip=case.get("clip")
        )
        model = _model()
        if rank == 1:  # different until broadcast
            for p in model.parameters():
                p.data.add_(1.0)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if case.get("compression") else hvd.Compression.none,
            op=getattr(hvd, case.get("op", "Average")),
            gradient_predivide_factor=case.get("gradient_predivide_factor", 1.0),
            backward_passes_per_step=case.get("backward_passes_per_step", 1),
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        passes = case.get("backward_passes_per_step", 1)
        _train(model, opt, x[mine], y[mine], 3, passes=passes, clip=case.get("clip"), hvd=hvd)
        out[name] = (
            max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), oracle.parameters())),
            [p.detach().numpy().copy() for p in model.parameters()],
            len(opt._sync.ddp.reducer.layout.buckets),
        )
    # misuse, named as Horovod names it
    model = _model()
    extra = torch.nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([*model.parameters(), extra], lr=0.1),
        named_parameters=[*model.named_parameters(), ("extra", extra)],
    )
    torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    out["unused_grad"] = extra.grad.tolist()  # no grad here, nor on the other rank: zeros reduced
    out["zero_grad_early"] = error_of(opt.zero_grad)
    out["second_backward"] = error_of(
        lambda: torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    )
    opt.step()
    out["adasum"] = error_of(lambda: hvd.DistributedOptimizer(opt, op=hvd.Adasum))
    out["unnamed"] = error_of(
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), named_parameters=[])
    )
    hvd.shutdown()
    return out


@pytest.mark.slow
def test_distributed_optimizer_equals_one_process_on_the_full_batch():
    r0, r1 = run_ranks(_optimizer, WORLD, timeout=180)
    for name in CASES:
        tol = 2e-3 if name == "fp16" else 1e-6
        assert r0[name][0] < tol, (name, r0[name][0])
        assert all(np.array_equal(a, b) for a, b in zip(r0[name][1], r1[name][1])), name
        assert r0[name][2] == 1  # 4 grads fused into one bucket: one all-reduce a step
    assert r0["unused_grad"] == r1["unused_grad"] == [0.0, 0.0]
    for r in (r0, r1):
        assert "zero_grad() was called after loss.backward()" in r["zero_grad_early"]
        assert "computed more than backward_passes_per_step times" in r["second_backward"]
        assert "op=hvd.Adasum is not supported" in r["adasum"]
        assert "are not named in it" in r["unnamed"]
