"""nccl_ddp.fully_shard in torch's thread world (torch.testing's multi_threaded_pg: every rank a
thread of one process, backend "threaded"), where our groups are host groups whose collectives
torch carries (adapters/torch/carried.py): training equals torch's own fully_shard in the same
thread world bit for bit (losses and parameters), nothing of ours outlives the rank threads and
the models, torch's fake backend is refused, and the carrier over a process-wide backend (gloo,
whose works wait with our timeout) reduces every op as the host backend does (AVG truncating
integers, the pre-scaled sum)."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from typing import Any, Set

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

import torch.distributed as dist  # noqa: E402
from fsdp_cases import full_params, gloo, shard_blocks, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402
from thread_world import thread_world  # noqa: E402

STEPS = 4


def _ours_threads() -> Set[str]:
    """Our groups' workers and our streams' threads (fully_shard's comm stream)."""
    return {t.name for t in threading.enumerate() if t.name.startswith(("nccl_ddp", "host-stream"))}


def _assert_none_left(before: Set[str]) -> None:
    """No thread of ours started since `before` is alive (within 5 s, collecting cycles)."""
    deadline = time.monotonic() + 5.0
    while _ours_threads() - before and time.monotonic() < deadline:
        gc.collect()  # the models' reference cycles (module <-> hooks): their comm streams close
        time.sleep(0.05)
    assert not _ours_threads() - before, "threads of nccl_ddp outlived the thread world and its models"


def _parity(rank: int) -> dict:
    torch.set_num_threads(1)
    got = {}
    first = transformer()
    for p in first.parameters():  # the seed is the process's, drawn from by both rank threads
        dist.broadcast(p.detach(), src=0)
    for who, fs in torch_and_ours():
        model = shard_blocks(copy.deepcopy(first), fs)
        res = train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), tokens(rank, STEPS))
        res["params"] = full_params(model)
        got[who] = res
    return got


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_matches_torch_fully_shard_in_the_thread_world():
    before = _ours_threads()
    results = thread_world(_parity, 2)
    for rank, res in enumerate(results):
        ref, ours = res["torch"], res["ours"]
        assert len(ours["losses"]) == STEPS and len(set(ours["losses"])) > 1  # it trained
        assert ours["losses"] == ref["losses"], f"rank {rank}"  # bit for bit: torch sums for both
        assert ours["params"].keys() == ref["params"].keys()
        for name, p in ours["params"].items():
            np.testing.assert_array_equal(p, ref["params"][name], err_msg=name)
    assert results[0]["ours"]["losses"] != results[1]["ours"]["losses"]  # ranks saw different data
    _assert_none_left(before)


def _cast_after_init(rank: int, mixed: bool) -> dict:
    """torch's test_to_float64_after_init, ours beside torch's: shard in_proj, out_proj and the
    root (`mixed`: computing in bfloat16), then cast the whole model to float64 and train 5 Adam
    steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.testing._internal.common_fsdp import MLP

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mixed else {}

    torch.set_num_threads(1)
    first, g = MLP(4), torch.Generator().manual_seed(0)  # the same values on both rank threads
    with torch.no_grad():
        for p in first.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    got = {}
    for who, fs in torch_and_ours():
        model = copy.deepcopy(first)
        for m in (model.in_proj, model.out_proj, model):
            fs(m, **kw)
        model.to(torch.float64)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            loss = model(x).float().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        dtypes = {(p.dtype, p.to_local().dtype) for p in model.parameters()}
        got[who] = {"losses": losses, "dtypes": dtypes, "params": full_params(model)}
    return got


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True], ids=["float64", "float64-bf16-compute"])
def test_cast_to_float64_after_fully_shard_trains_as_torch(mixed):
    for rank, res in enumerate(thread_world(lambda r: _cast_after_init(r, mixed), 2)):
        ours, ref = res["ours"], res["torch"]
        assert ours["dtypes"] == ref["dtypes"] == {(torch.float64, torch.float64)}
        assert len(set(ours["losses"])) > 1 and ours["losses"] == ref["losses"], f"rank {rank}"
        for name, p in ours["params"].items():
            np.testing.assert_array_equal(p, ref["params"][name], err_msg=name)


def _gathered_forward(rank: int) -> Any:
    """Ranks whose weights differ (fully_shard checks shapes, not values): the forward's
    all-gather (ours, carried by torch) puts rank 0's rows 0-1 and rank 1's rows 2-3 together."""
    import nccl_ddp as nd

    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(rank + 1.0)
    nd.fully_shard(model)
    with torch.no_grad():
        return model(torch.ones(1, 4))


@pytest.mark.slow
def test_the_forward_gathers_every_rank_shard_in_the_thread_world():
    for out in thread_world(_gathered_forward, 2):
        assert out.tolist() == [[4.0, 4.0, 8.0, 8.0]]


def _forget_a_model(rank: int, refs: list) -> None:
    import nccl_ddp as nd

    model = torch.nn.Linear(4, 4)
    refs.append(weakref.ref(model))
    nd.fully_shard(model)
    model(torch.ones(1, 4)).sum().backward()


@pytest.mark.slow
def test_a_freed_model_takes_its_comm_stream_along():
    """fully_shard's finalizer held the schedule, whose units hold the module: the model and its
    comm stream's thread lived on until the process ended."""
    before, refs = _ours_threads(), []
    thread_world(lambda rank: _forget_a_model(rank, refs), 2)
    _assert_none_left(before)
    assert [r() for r in refs] == [None, None], "the sharded models outlived every reference"


def test_fake_backend_is_refused():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ConfigError, match="fake backend runs no collectives"):
            nd.fully_shard(torch.nn.Linear(4, 4))
    finally:
        dist.destroy_process_group()


def _carried_over_gloo(rank: int, world: int, store_dir: str) -> dict:
    from nccl_ddp.adapters.torch.carried import carried_group
    from nccl_ddp.comm.group import ReduceOp

    with gloo(rank, world, store_dir):
        g = carried_group(dist.group.WORLD, "gloo", "test")
        out = {"name": g.name, "kind": g.transport_kind}
        ints = np.array([rank * 3 - 4, 7, -7], dtype=np.int64)  # sums -5, 14, -14
        g.all_reduce(ints, ReduceOp.AVG).wait()
        out["avg_int"] = ints.tolist()
        x = np.full(3, rank + 1.0, dtype=np.float32)
        g.all_reduce_premul_sum(x, 0.5).wait()
        out["premul"] = x.tolist()
        gathered = np.zeros(4, np.float64)
        g.all_gather(gathered, np.array([rank, rank + 0.5])).wait()
        out["gather"] = gathered.tolist()
        part = np.zeros(2, np.float32)
        g.reduce_scatter(part, np.arange(4, dtype=np.float32) * (rank + 1), ReduceOp.MAX).wait()
        out["scatter_max"] = part.tolist()
        b = np.full(2, float(rank), np.float32)
        g.broadcast(b, root=1).wait()
        out["bcast"] = b.tolist()
        g.barrier().wait()
        g.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_carrier_over_gloo_reduces_as_the_host_backend(tmp_path):
    results = run_ranks(_carried_over_gloo, 2, str(tmp_path), timeout=90)
    for rank, res in enumerate(results):
        assert res["kind"] == "torch:gloo" and res["name"] == "torch-gloo-group[0,1]"
        assert res["avg_int"] == [-2, 7, -7]  # -5 / 2 truncates toward zero, as NCCL's ncclAvg
        assert res["premul"] == [1.5, 1.5, 1.5]  # 0.5 * 1 + 0.5 * 2
        assert res["gather"] == [0.0, 0.5, 1.0, 1.5]
        assert res["scatter_max"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert res["bcast"] == [1.0, 1.0]
