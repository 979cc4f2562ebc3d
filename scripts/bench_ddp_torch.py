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

from typing import Callable

from benchlib import POWERSGD_RANK, init_torch_pg, our_hook, sent_mib, slowest, timed_steps


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


def torch_hook(ddp, hook: str, rank_r: int):
    """Register torch's hook matching ours on torch's DDP; returns PowerSGD's state (else None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, torch_bf16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return state
    return None


def torch_bf16_compress_hook(process_group, bucket):
    """torch's bf16_compress_hook without its NCCL-version check (which refuses gloo): the same
    cast, division and all-reduce."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def run_torch(nd, xp, args, cap_mb: float, hook: str = "allreduce") -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from nccl_ddp.profiling import Timeline

    ours_backend = nd.get_world_group().backend
    cuda = ours_backend == "nccl"
    device = torch.device("cuda", nd.get_local_rank()) if cuda else torch.device("cpu")
    torch_backend = init_torch_pg(nd, torch, "nccl" if cuda else "gloo")
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
    torch_state = torch_hook(torch_ddp, hook, POWERSGD_RANK)
    theirs_step = stepper(theirs, torch_ddp)
    t_torch = _timed(nd, torch, theirs_step, args, cuda)
    torch_before = torch_state.total_numel_after_compression if torch_state else 0
    for _ in range(args.profile_steps):
        theirs_step()

    mine = _mlp(torch, dims, device)
    ddp = nd.DistributedDataParallel(mine, bucket_cap_mb=cap_mb)
    state = our_hook(nd, ddp, hook)
    step = stepper(mine, ddp)
    t_ddp = _timed(nd, torch, step, args, cuda)
    ddp.reducer.prof = Timeline(nd.get_rank(), timeline=True)
    before = state.total_numel_after_compression if state else 0
    for _ in range(args.profile_steps):
        step()
    steps = list(ddp.reducer.prof.steps)
    comm = sum(s.comm_s for s in steps) / max(1, len(steps))
    hidden = sum(s.overlap_s for s in steps) / max(1e-12, sum(s.comm_s for s in steps))
    comm = slowest(nd, comm)
    nbytes = sum(b.nbytes for b in ddp.reducer.layout.buckets)
    buckets = ddp.reducer.layout.buckets
    row = dict(
        mode="torch",
        hook=hook,
        ranks=nd.get_world_size(),
        sent_MiB=sent_mib(buckets, hook, state, before, args.profile_steps),
        torch_sent_MiB=sent_mib(buckets, hook, torch_state, torch_before, args.profile_steps),
        backend=f"{ours_backend}/{torch_backend}",
        params_MiB=nbytes / 2**20,
        cap_MiB=cap_mb,
        buckets=len(ddp.reducer.layout.buckets),
        local_ms=t_local * 1e3,
        ddp_ms=t_ddp * 1e3,
        overhead_ms=(t_ddp - t_local) * 1e3,
        comm_ms=comm * 1e3,
        hidden_pct=100.0 * hidden,
        torch_ddp_ms=t_torch * 1e3,
        ratio=t_ddp / t_torch,
    )
    ddp.close()
    return row
