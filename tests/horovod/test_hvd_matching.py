"""Horovod's matching of collectives on 2 ranks (nccl_ddp/horovod/negotiation.py): inputs that
differ across ranks are refused on every rank before data moves and the group stays usable; ops
are matched by name, whatever order each rank issues them in; duplicate names are refused;
Horovod's integer semantics; object collectives after a failed pickle; join; truthful poll."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import error_of, run_ranks  # noqa: E402

WORLD = 2


def _mismatches(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    hvd.init()
    out: dict = {}
    ok = torch.ones(4)
    shape = (2, 3) if rank == 0 else (3, 2)
    out["allreduce"] = error_of(lambda: hvd.allreduce(torch.ones(shape)))
    out["after_allreduce"] = hvd.allreduce(ok, op=hvd.Sum).tolist()
    rows = (4, 3) if rank == 0 else (2, 6)
    out["reducescatter"] = error_of(lambda: hvd.reducescatter(torch.ones(rows), op=hvd.Sum))
    out["broadcast_"] = error_of(lambda: hvd.broadcast_(torch.full(shape, float(rank)), root_rank=0))
    group = [torch.ones(3), torch.ones(3)] if rank == 0 else [torch.ones(6)]
    out["grouped"] = error_of(lambda: hvd.grouped_allreduce(group, op=hvd.Sum))
    out["dtype"] = error_of(
        lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if rank else torch.float32))
    )
    out["root"] = error_of(lambda: hvd.broadcast(torch.ones(3), root_rank=rank))
    out["op"] = error_of(lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if rank else hvd.Max))
    out["kind"] = error_of(
        lambda: hvd.allreduce(torch.ones(3), name="x") if rank else hvd.allgather(torch.ones(3), name="x")
    )
    out["after_all"] = hvd.allreduce(ok, op=hvd.Sum).tolist()  # the group still works
    # the same names, issued in different orders: matched by name
    a, b = torch.full((3,), 1.0 + rank), torch.full((5,), 10.0 * (rank + 1))
    if rank == 0:
        ha, hb = hvd.allreduce_async(a, name="a", op=hvd.Sum), hvd.allreduce_async(b, name="b", op=hvd.Sum)
    else:
        hb, ha = hvd.allreduce_async(b, name="b", op=hvd.Sum), hvd.allreduce_async(a, name="a", op=hvd.Sum)
    out["poll_before"] = (hvd.poll(ha), hvd.poll(hb))
    first, second = (ha, hb) if rank == 0 else (hb, ha)  # each rank waits on another name first
    got = {first: hvd.synchronize(first), second: hvd.synchronize(second)}
    out["by_name"] = (got[ha].tolist(), got[hb].tolist())
    # grouped_allreduce with the same tensors in another order: matched by name, so refused
    pair = [torch.ones(2), torch.ones(3)]
    out["grouped_order"] = error_of(
        lambda: hvd.grouped_allreduce(pair if rank == 0 else pair[::-1], op=hvd.Sum)
    )
    # duplicate names while one is pending: refused on that rank (ValueError), as Horovod's
    h = hvd.allreduce_async(torch.ones(2), name="dup", op=hvd.Sum)
    dup = error_of(lambda: hvd.allreduce_async(torch.ones(2), name="dup"))
    out["duplicate"] = (dup, isinstance_of_value_error(hvd, dup), hvd.synchronize(h).tolist())
    hvd.barrier()
    hvd.shutdown()
    return out


def isinstance_of_value_error(hvd, text: str) -> bool:
    import nccl_ddp.errors as errors

    return issubclass(getattr(errors, text.split(":")[0]), ValueError)


@pytest.fixture(scope="module")
def mismatches():
    return run_ranks(_mismatches, WORLD, timeout=120)


@pytest.mark.slow
def test_inputs_that_differ_across_ranks_are_refused_on_every_rank(mismatches):
    for r in mismatches:
        assert "RankMismatchError" in r["allreduce"]
        assert "Mismatched allreduce tensor shapes: One rank sent a tensor of shape [2, 3]" in r["allreduce"]
        assert "but another rank sent a tensor of shape [3, 2]" in r["allreduce"]
        assert (
            "Mismatched reducescatter tensor shapes" in r["reducescatter"] and "[4, 3]" in r["reducescatter"]
        )
        assert "Mismatched broadcast tensor shapes" in r["broadcast_"]
        assert "Mismatched grouped_allreduce tensor shapes" in r["grouped"]
        assert (
            "Mismatched data types: One rank had type float32, but another rank had type float64"
            in r["dtype"]
        )
        assert "Mismatched broadcast root ranks" in r["root"]
        assert "Mismatched reduction operation" in r["op"]
        assert (
            "Mismatched operations: One rank did an ALLGATHER, but another rank did an ALLREDUCE" in r["kind"]
        )
        assert "Mismatched grouped_allreduce tensor shapes" in r["grouped_order"]
        # no data moved: the group is usable after each
        assert r["after_allreduce"] == r["after_all"] == [2.0] * 4


@pytest.mark.slow
def test_ops_are_matched_by_name_and_duplicates_refused(mismatches):
    for r in mismatches:
        assert r["poll_before"] == (False, False)  # queued until some rank waits on one
        assert r["by_name"] == ([3.0] * 3, [30.0] * 5)
        dup, is_value_error, first = r["duplicate"]
        assert (
            "same name as another tensor that is currently being processed ('dup')" in dup and is_value_error
        )
        assert first == [2.0, 2.0]


def _semantics(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    hvd.init()
    out: dict = {}
    x = torch.tensor([[5, -5], [3, -3], [7, 1], [2, 2]], dtype=torch.int32) * (rank + 1)  # sum: 3x
    out["rs_avg"] = hvd.reducescatter(x, op=hvd.Average).tolist()
    out["rs_scaled"] = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5).tolist()
    out["grouped_rs"] = [t.tolist() for t in hvd.grouped_reducescatter([x, x[:2]], op=hvd.Average)]
    out["ar_avg"] = hvd.allreduce(torch.tensor([5, -5, 4], dtype=torch.int64) * (rank + 1)).tolist()
    out["ar_scaled"] = hvd.allreduce(
        torch.tensor([5, -5], dtype=torch.int64), op=hvd.Sum, prescale_factor=0.3, postscale_factor=2.5
    ).tolist()
    # an object that cannot be pickled on rank 0, caught: no later call pairs with it
    bad = (lambda: 0) if rank == 0 else ("fine", rank)
    out["bad_gather"] = error_of(lambda: hvd.allgather_object(bad))
    out["next_gather"] = hvd.allgather_object(("next", rank))
    out["bad_bcast"] = error_of(lambda: hvd.broadcast_object(bad, root_rank=0))
    out["next_bcast"] = hvd.broadcast_object(("root", rank), root_rank=0)
    # join: rank 0 joins at once; rank 1's allreduces average over both ranks with rank 0's zeros
    if rank == 0:
        out["join"] = hvd.join()
    else:
        t = torch.full((3,), 8.0)
        h = hvd.allreduce_async(t, name="late")
        out["joined_avg"] = hvd.synchronize(h).tolist()
        out["joined_refused"] = error_of(lambda: hvd.allgather(torch.ones(2)))
        out["join"] = hvd.join()
    out["built"] = (hvd.nccl_built(), hvd.cuda_built())
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def semantics():
    return run_ranks(_semantics, WORLD, timeout=120)


@pytest.mark.slow
def test_integer_average_and_scaling_are_horovods(semantics):
    r0, r1 = semantics
    total = np.array([[15, -15], [9, -9], [21, 3], [6, 6]])
    trunc = lambda a: np.trunc(a).astype(np.int64).tolist()  # noqa: E731
    assert r0["rs_avg"] == trunc(total[:2] / 2) and r1["rs_avg"] == trunc(total[2:] / 2)
    x0 = np.array([[5, -5], [3, -3], [7, 1], [2, 2]])
    pre = np.trunc(x0 * 0.5) + np.trunc(2 * x0 * 0.5)  # each rank's prescale, rounded toward zero
    assert r0["rs_scaled"] == trunc(pre[:2] * 1.5) and r1["rs_scaled"] == trunc(pre[2:] * 1.5)
    assert r0["grouped_rs"] == [trunc(total[:2] / 2), trunc(total[:1] / 2)]
    for r in semantics:
        assert r["ar_avg"] == [7, -7, 6]  # 15/2, -15/2, 12/2 toward zero
        assert r["ar_scaled"] == [5, -5]  # (1 + 1) * 2.5, (-1 - 1) * 2.5


@pytest.mark.slow
def test_object_collectives_after_a_failed_pickle_pair_with_nothing(semantics):
    r0, r1 = semantics
    assert "cannot pickle the object: " in r0["bad_gather"] and "cannot pickle" in r0["bad_bcast"]
    assert "the object of ranks [0] could not be pickled" in r1["bad_gather"]
    assert "the object of ranks [0] could not be pickled" in r1["bad_bcast"]
    for r in semantics:
        assert r["next_gather"] == [("next", 0), ("next", 1)]
        assert r["next_bcast"] == ("root", 0)


@pytest.mark.slow
def test_join_and_built_queries(semantics):
    r0, r1 = semantics
    assert r1["joined_avg"] == [4.0] * 3  # (8 + rank 0's zeros) / 2
    assert "not supported with Join" in r1["joined_refused"]
    assert r0["join"] == r1["join"] == 1  # the last rank to join
    from nccl_ddp.comm.nccl.runtime import is_available
    from nccl_ddp.device.cuda import cuda_available

    for r in semantics:  # False on a host without a GPU (where Horovod's alltoall tests skip)
        assert r["built"] == (is_available(), cuda_available())


def _autograd(rank: int, world: int) -> dict:
    import nccl_ddp.horovod.torch as hvd

    hvd.init()
    out: dict = {}
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    sa, sb = hvd.grouped_allreduce([a * (rank + 1), b], op=hvd.Sum)
    (sa.sum() + sb.sum()).backward()
    out["grouped"] = (a.grad.tolist(), b.grad.tolist())
    x = torch.ones(5, 2, requires_grad=True)
    hvd.reducescatter(x * (rank + 1), op=hvd.Sum).sum().backward()
    out["reducescatter"] = x.grad.tolist()
    y = torch.arange(3.0, requires_grad=True)
    got, received = hvd.alltoall(y * (rank + 1), splits=[1, 2] if rank == 0 else [2, 1])
    (got * torch.arange(1.0, 1.0 + got.shape[0])).sum().backward()
    out["alltoall"] = (y.grad.tolist(), received.tolist())
    sparse = torch.sparse_coo_tensor([[rank, 3]], [1.0, 2.0], (4,), check_invariants=True)
    out["sparse"] = hvd.sparse_allreduce_async(sparse, "s", hvd.Average)().to_dense().tolist()
    hs = hvd.grouped_reducescatter_async([torch.ones(2, 2) * (rank + 1)], name="g", op=hvd.Sum)
    out["grouped_rs_async"] = [hvd.synchronize(h).tolist() for h in hs]
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def autograd():
    return run_ranks(_autograd, WORLD, timeout=120)


@pytest.mark.slow
def test_autograd_of_grouped_allreduce_reducescatter_alltoall(autograd):
    r0, r1 = autograd
    for r, factor in ((r0, 1.0), (r1, 2.0)):
        # Sum's gradient is the Sum allreduce of the ones (Horovod's): 2, times this rank's factor
        assert r["grouped"] == ([2.0 * factor] * 3, [[2.0, 2.0], [2.0, 2.0]])
        # Horovod's reducescatter gradient: the grads gathered, times size for Sum
        assert r["reducescatter"] == [[2.0 * factor] * 2] * 5
    # alltoall's gradient: each received row's weight (its position + 1) sent back to its sender
    # rank 0 got [r0 row 0, r1 rows 0-1] (weights 1, 2, 3); rank 1 got [r0 rows 1-2, r1 row 2]
    assert r0["alltoall"] == ([1.0, 1.0, 2.0], [1, 2]) and r1["alltoall"] == ([4.0, 6.0, 6.0], [2, 1])
    for r in autograd:
        assert r["sparse"] == [0.5, 0.5, 0.0, 2.0]  # (e_rank + 2 e_3) summed over ranks, / 2
    assert r0["grouped_rs_async"] == [[[3.0, 3.0]]] and r1["grouped_rs_async"] == [[[3.0, 3.0]]]
