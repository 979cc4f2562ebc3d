"""nccl_ddp beside a torch.distributed that a script started first (torch's mp.spawn recipes, Ray
Train, torchrun scripts), 2 CPU processes on gloo, torch's own DDP / ZeroRedundancyOptimizer as the
oracle:

- `nd.init_process_group()` after `dist.init_process_group("gloo")` (env://, whose TCPStore holds
  MASTER_PORT) gets its store port and secret from rank 0 through torch.distributed: no bind
  error, no "store has no secret" warning; in an mp.spawn recipe (no launcher variables, ranks
  given to torch only) it takes torch's ranks instead of training alone.
- `nd.DistributedDataParallel(model)` and `nd.ZeroRedundancyOptimizer(...)` with torch.distributed
  up and ours not join our group by themselves: torch's ZeroRedundancyOptimizer tutorial runs
  with only its import changed.
Training then equals torch DDP's to 1e-6.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from mp import run_ranks
from torch_oracle import OracleConfig, make_model, train

pytest.importorskip("torch", reason="PyTorch is not installed")

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
CONFIG = OracleConfig(steps=3)


class _Records(logging.Handler):
    """nccl_ddp's log records at WARNING and above, kept for the test to read."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list = []
        logging.getLogger("nccl_ddp").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _torch_first(rank: int, world: int, spawn_style: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    torch.set_num_threads(1)
    os.environ.pop("NCCL_DDP_SECRET")  # torchrun and mp.spawn set none
    if spawn_style:  # mp.spawn: the script sets MASTER_ADDR/PORT and passes the ranks to torch
        for var in LAUNCHER_VARS:
            os.environ.pop(var)
    records = _Records()
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env://: MASTER_PORT is torch's
    try:
        nd.init_process_group()
        where = (nd.get_rank(), nd.get_world_size(), nd.get_world_group().backend)
        model = make_model(rank)
        ours = train(nd.DistributedDataParallel(model, find_unused_parameters=True), model, rank, CONFIG)
        model = make_model(rank)
        theirs = train(TorchDDP(model, find_unused_parameters=True), model, rank, CONFIG)
        nd.destroy_process_group()
    finally:
        dist.destroy_process_group()
    return {"where": where, "ours": ours, "torch": theirs, "warnings": records.messages}


@pytest.mark.slow
@pytest.mark.parametrize("spawn_style", [True, False], ids=["mp.spawn", "torchrun-env"])
def test_init_process_group_after_torch_distributed(spawn_style):
    results = run_ranks(_torch_first, 2, spawn_style, timeout=240)
    for rank, r in enumerate(results):
        assert r["where"] == (rank, 2, "host")
        assert r["warnings"] == [], r["warnings"]  # neither "no secret" nor "job of one"
        for key, value in r["torch"].items():
            np.testing.assert_allclose(r["ours"][key], value, rtol=1e-6, atol=1e-6, err_msg=key)


def _zero_tutorial(rank: int, world: int, ours: bool) -> dict:
    """torch's ZeroRedundancyOptimizer tutorial (recipes/zero_redundancy_optimizer), on the CPU
    and smaller; with `ours` the only change is the import."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ours:
        from nccl_ddp import ZeroRedundancyOptimizer
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    for var in LAUNCHER_VARS + ("NCCL_DDP_SECRET",):
        os.environ.pop(var)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.Sequential(*[nn.Linear(40, 40) for _ in range(4)])
        ddp_model = DDP(model)
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            outputs = ddp_model(torch.randn(20, 40, generator=g))
            labels = torch.randn(20, 40, generator=g)
            nn.MSELoss()(outputs, labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torch_zero_tutorial_with_only_the_import_changed():
    theirs = run_ranks(_zero_tutorial, 2, False, timeout=240)
    ours = run_ranks(_zero_tutorial, 2, True, timeout=240)
    for rank in range(2):
        for key, value in theirs[rank].items():
            np.testing.assert_allclose(ours[rank][key], value, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {key}")
