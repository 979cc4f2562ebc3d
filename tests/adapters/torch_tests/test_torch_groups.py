"""torch.distributed started first with nothing of ours in the environment, and torch's groups
passed where ours go (2 CPU processes, gloo, torch's DDP as the oracle):

- torch started from `file://`, `tcp://`, or an explicit `store=` (FileStore, TCPStore), with no
  MASTER_ADDR/MASTER_PORT/RANK/NCCL_DDP_* set: our DDP joins our group beside it (rank 0's store
  address, port and secret sent through torch's collectives) and trains equal to torch's DDP.
- `process_group=` a torch group: the world (`dist.group.WORLD`, a `new_group` of every rank)
  maps to our world group, a subgroup to one of ours over the same global ranks, built by its
  members only; the same for `ZeroRedundancyOptimizer(process_group=)` and the grad reducer's
  `group=`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import LAUNCHER_VARS, free_port, run_ranks
from torch_oracle import OracleConfig, make_model, train

pytest.importorskip("torch", reason="PyTorch is not installed")

CONFIG = OracleConfig(steps=2)


def _start_torch(rank: int, world: int, how: str, where: str) -> None:
    """torch.distributed on gloo as a script would start it with `how`, from nothing in the
    environment (the launcher's variables that run_ranks sets are dropped first)."""
    import datetime

    import torch.distributed as dist

    for var in (*LAUNCHER_VARS, "NCCL_DDP_STORE_PORT"):
        os.environ.pop(var, None)
    if how == "file":
        dist.init_process_group("gloo", init_method=f"file://{where}", rank=rank, world_size=world)
    elif how == "tcp":
        dist.init_process_group("gloo", init_method=f"tcp://{where}", rank=rank, world_size=world)
    elif how == "filestore":
        dist.init_process_group("gloo", store=dist.FileStore(where, world), rank=rank, world_size=world)
    else:
        host, port = where.split(":")
        store = dist.TCPStore(host, int(port), world, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _both(rank: int, ddp: type, **kwargs) -> dict:
    model = make_model(rank)
    return train(ddp(model, find_unused_parameters=True, **kwargs), model, rank, CONFIG)


def _joins_torch(rank: int, world: int, how: str, where: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    torch.set_num_threads(1)
    _start_torch(rank, world, how, where)
    try:
        ours = _both(rank, nd.DistributedDataParallel)  # joins our group by itself
        where_we_are = (nd.get_rank(), nd.get_world_size())
        theirs = _both(rank, TorchDDP)
        nd.destroy_process_group()
    finally:
        dist.destroy_process_group()
    return {"where": where_we_are, "ours": ours, "torch": theirs}


def _assert_equal_training(results: list) -> None:
    for r in results:
        for key, value in r["torch"].items():
            np.testing.assert_allclose(r["ours"][key], value, rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["file", "tcp", "filestore", "tcpstore"])
def test_joins_torch_started_from_any_init_method_with_nothing_in_the_environment(how, tmp_path):
    where = str(tmp_path / "rendezvous") if how in ("file", "filestore") else f"127.0.0.1:{free_port()}"
    results = run_ranks(_joins_torch, 2, how, where, timeout=240)
    assert [r["where"] for r in results] == [(0, 2), (1, 2)]
    _assert_equal_training(results)


def _torch_groups(rank: int, world: int, where: str) -> dict:
    """Each way a torch script hands its groups to DDP, ours beside torch's: WORLD, a new_group
    of every rank, and each rank's own group of one (rank 0 builds two models on it, rank 1
    one: a subgroup is built by its members alone). Then ZeroRedundancyOptimizer and the grad
    reducer on torch's WORLD."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    torch.set_num_threads(1)
    _start_torch(rank, world, "file", where)
    out: dict = {}
    try:
        everyone = dist.new_group([0, 1])
        alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank calls new_group
        for name, group in (("WORLD", dist.group.WORLD), ("new_group", everyone), ("alone", alone)):
            model = make_model(rank)
            ddp = nd.DistributedDataParallel(model, process_group=group, find_unused_parameters=True)
            out[name] = {"ranks": list(ddp.process_group.ranks), "ours": train(ddp, model, rank, CONFIG)}
            out[name]["torch"] = _both(rank, TorchDDP, process_group=group)
            if name == "alone" and rank == 0:
                again = nd.DistributedDataParallel(make_model(rank), process_group=group)
                out["alone"]["same group again"] = again.process_group is ddp.process_group
        model = make_model(rank)
        ddp = nd.DistributedDataParallel(model, process_group=dist.group.WORLD)
        opt = nd.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, process_group=dist.group.WORLD
        )
        out["zero group is the model's"] = opt.group is ddp.process_group is nd.get_world_group()
        grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1))]
        reducer = nd.DistributedGradReducer(
            [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))],
            group=dist.group.WORLD,
        )
        out["reduced"] = [g.tolist() for g in reducer(grads)]
        nd.destroy_process_group()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_groups_as_process_group(tmp_path):
    results = run_ranks(_torch_groups, 2, str(tmp_path / "rendezvous"), timeout=240)
    for rank, r in enumerate(results):
        assert r["WORLD"]["ranks"] == r["new_group"]["ranks"] == [0, 1]
        assert r["alone"]["ranks"] == [rank]
        for name in ("WORLD", "new_group", "alone"):
            _assert_equal_training([r[name]])
        assert r["zero group is the model's"]
        assert r["reduced"] == [[1.5] * 3, [[15.0, 15.0], [15.0, 15.0]]]
    assert results[0]["alone"]["same group again"]
