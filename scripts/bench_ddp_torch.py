"""The "torch" mode of scripts/bench_ddp.py: the same ReLU MLP as nn.Sequential, one training step
(forward, MSE loss, backward, SGD, zero_grad) timed three ways in the same processes:
without DDP (local_ms), with our DistributedDataParallel (ddp_ms) and with
torch.nn.parallel.DistributedDataParallel (torch_ddp_ms; gloo on the host backend, NCCL on GPUs),
both with the same bucket cap and grads as bucket views. ratio = ddp_ms / torch_ddp_ms
(below 1: ours is faster).

torch.distributed gets its own rendezvous on a port rank 0 picks and broadcasts through our
process group, so it never competes with nccl-ddp-run's store.
"""
from __future__ import annotations

import socket
from typing import Callable

import numpy as np

from benchlib import array_module, slowest, timed_steps

_TORCH_PG = {}


def _init_torch_pg(nd, torch, backend: str) -> None:
    """One torch.distributed group per process (all caps share it)."""
    if _TORCH_PG:
        return
    import torch.distributed as dist
    port = array_module(nd).zeros(1, dtype=np.int64)   # cupy on the nccl backend
    if nd.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    nd.broadcast(port, 0)
    import os
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{int(port[0])}",
                            rank=nd.get_rank(), world_size=nd.get_world_size())
    _TORCH_PG["backend"] = backend


def _mlp(torch, dims, device):
    layers = []
    for i, (n_in, n_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    torch.manual_seed(0)
    return torch.nn.Sequential(*layers).to(device)


def _timed(nd, torch, step: Callable[[], None], args, cuda: bool) -> float:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return timed_steps(nd, step, args.warmup, args.steps, sync)


def run_torch(nd, xp, args, cap_mb: float) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from nccl_ddp.profiling import Timeline
    ours_backend = nd.get_world_group().backend
    cuda = ours_backend == "nccl"
    device = torch.device("cuda", nd.get_local_rank()) if cuda else torch.device("cpu")
    _init_torch_pg(nd, torch, "nccl" if cuda else "gloo")
    dims = [args.features] + [args.hidden] * args.layers + [1]
    g = torch.Generator().manual_seed(nd.get_rank())
    x = torch.randn(args.batch, args.features, generator=g).to(device)
    y = torch.randn(args.batch, 1, generator=g).to(device)

    def stepper(model, wrapped):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            loss = torch.nn.functional.mse_loss(wrapped(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    local = _mlp(torch, dims, device)
    t_local = _timed(nd, torch, stepper(local, local), args, cuda)

    theirs = _mlp(torch, dims, device)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    t_torch = _timed(nd, torch, stepper(theirs, torch_ddp), args, cuda)

    mine = _mlp(torch, dims, device)
    ddp = nd.DistributedDataParallel(mine, bucket_cap_mb=cap_mb)
    step = stepper(mine, ddp)
    t_ddp = _timed(nd, torch, step, args, cuda)
    ddp.reducer.prof = Timeline(nd.get_rank(), timeline=True)
    for _ in range(args.profile_steps):
        step()
    steps = list(ddp.reducer.prof.steps)
    comm = sum(s.comm_s for s in steps) / max(1, len(steps))
    hidden = sum(s.overlap_s for s in steps) / max(1e-12, sum(s.comm_s for s in steps))
    comm = slowest(nd, comm)
    nbytes = sum(b.nbytes for b in ddp.reducer.layout.buckets)
    row = dict(mode="torch", ranks=nd.get_world_size(),
               backend=f"{ours_backend}/{_TORCH_PG['backend']}", params_MiB=nbytes / 2**20,
               cap_MiB=cap_mb, buckets=len(ddp.reducer.layout.buckets), local_ms=t_local * 1e3,
               ddp_ms=t_ddp * 1e3, overhead_ms=(t_ddp - t_local) * 1e3,
               comm_ms=comm * 1e3, hidden_pct=100.0 * hidden,
               torch_ddp_ms=t_torch * 1e3, ratio=t_ddp / t_torch)
    ddp.close()
    return row
