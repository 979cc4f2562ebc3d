"""The "torch" mode of scripts/bench_ddp.py: the same ReLU MLP as nn.Sequential, one training step
(forward, MSE loss, backward, SGD, zero_grad) timed three ways in the same processes, in
--step-rounds interleaved rounds (medians shown):
without DDP (local_ms), with our DistributedDataParallel (ddp_ms) and with
torch.nn.parallel.DistributedDataParallel (torch_ddp_ms; gloo on the host backend, NCCL on GPUs),
both with the same bucket cap and grads as bucket views. ratio = ddp_ms / torch_ddp_ms
(below 1: ours is faster).

The limit (plain all-reduce hook): limit_ms = lockstep_ms + allreduce_ms: the local step with the
ranks waiting for each other after each step (a barrier, no grads sent: the wait for the slower
rank that every synchronous step pays, which the mean local step hides) plus the grads' bytes
all-reduced alone in one buffer in the same processes (on the host in the group's shared memory,
as DDP's buckets: the fastest all-reduce there is here): a step with its communication
neither hidden nor slowed; vs_limit = ddp_ms / limit_ms (torch_vs_limit the same for torch DDP).
Where our step's time goes, from the profiled steps (the reducer's timeline on): backward_ms,
exposed_ms (communication after backward ended: the last bucket and what queued behind it),
threads_cpu_ms (CPU time per step of every thread but the training one: our comm workers),
stall_ms (the training thread's time off the CPU per step, beyond the local step's: waiting for
communication, or for a core).

torch.distributed gets its own rendezvous on a port rank 0 picks and broadcasts through our
process group, so it never competes with nccl-ddp-run's store.
"""

from __future__ import annotations

import time
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


def _timed(nd, torch, step: Callable[[], None], args, cuda: bool, first: bool) -> float:
    """Mean seconds per step over --steps steps; the --warmup steps only in the first round."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return timed_steps(nd, step, args.warmup if first else 0, args.steps, sync)


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


def _allreduce_alone(nd, torch, nbytes: int, args, device, first: bool) -> float:
    """Seconds per all-reduce of the model's grad bytes in one float32 buffer, alone (no step
    around it): with the local step, the limit a DDP step would reach with nothing hidden. On the
    host, the buffer is in the group's shared memory, as DDP's buckets (the fastest all-reduce)."""
    import numpy as np

    from nccl_ddp.device import HostDevice

    cuda = device.type == "cuda"
    n = max(1, nbytes // 4)
    buf = torch.zeros(n, device=device) if cuda else nd.get_world_group().zeros(HostDevice(), n, np.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return timed_steps(nd, lambda: nd.all_reduce(buf), args.warmup if first else 1, args.steps, sync)


def _cpu_split(step: Callable[[], None], steps: int) -> tuple:
    """Per step of `step()`: (wall s, wall - this thread's CPU s (time it waited or was preempted),
    CPU s of every other thread of the process (comm workers))."""
    wall = main = proc = 0.0
    for _ in range(max(1, steps)):
        p0, c0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        step()
        t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        wall, main, proc = wall + t1 - t0, main + c1 - c0, proc + p1 - p0
    n = max(1, steps)
    return wall / n, (wall - main) / n, (proc - main) / n


def run_torch(nd, xp, args, cap_mb: float, hook: str = "allreduce") -> dict:
    import numpy as np
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
    local_step = stepper(local, local)
    theirs = _mlp(torch, dims, device)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    torch_state = torch_hook(torch_ddp, hook, POWERSGD_RANK)
    theirs_step = stepper(theirs, torch_ddp)
    mine = _mlp(torch, dims, device)
    ddp = nd.DistributedDataParallel(mine, bucket_cap_mb=cap_mb)
    state = our_hook(nd, ddp, hook)
    step = stepper(mine, ddp)
    nbytes = sum(b.nbytes for b in ddp.reducer.layout.buckets)
    # interleaved rounds, medians: a slow moment of the machine hits every column alike
    times: dict = {"local": [], "lockstep": [], "torch": [], "ddp": [], "ar": []}

    def lockstep() -> None:  # the local step, ranks waiting for each other after it (no grads sent)
        local_step()
        nd.barrier()

    for i in range(max(1, args.step_rounds)):
        times["local"].append(_timed(nd, torch, local_step, args, cuda, i == 0))
        times["lockstep"].append(_timed(nd, torch, lockstep, args, cuda, i == 0))
        times["torch"].append(_timed(nd, torch, theirs_step, args, cuda, i == 0))
        times["ddp"].append(_timed(nd, torch, step, args, cuda, i == 0))
        if hook == "allreduce":
            times["ar"].append(_allreduce_alone(nd, torch, nbytes, args, device, i == 0))
    med = {k: float(np.median(v)) for k, v in times.items() if v}
    t_local, t_torch, t_ddp, t_ar = med["local"], med["torch"], med["ddp"], med.get("ar")
    torch_before = torch_state.total_numel_after_compression if torch_state else 0
    for _ in range(args.profile_steps):
        theirs_step()
    local_cpu = _cpu_split(stepper(local, local), args.profile_steps)
    ddp.reducer.prof = Timeline(nd.get_rank(), timeline=True)
    before = state.total_numel_after_compression if state else 0
    ours_cpu = _cpu_split(step, args.profile_steps)
    steps = list(ddp.reducer.prof.steps)
    comm = sum(s.comm_s for s in steps) / max(1, len(steps))
    hidden = sum(s.overlap_s for s in steps) / max(1e-12, sum(s.comm_s for s in steps))
    comm = slowest(nd, comm)
    per_step = max(1, len(steps))
    buckets = ddp.reducer.layout.buckets
    phases = dict(
        backward_ms=slowest(nd, sum(s.backward_s for s in steps) / per_step) * 1e3,
        exposed_ms=slowest(nd, sum(s.comm_s - s.overlap_s for s in steps) / per_step) * 1e3,
        threads_cpu_ms=slowest(nd, ours_cpu[2]) * 1e3,
        stall_ms=slowest(nd, ours_cpu[1] - local_cpu[1]) * 1e3,
    )
    if t_ar is not None:
        limit = med["lockstep"] + t_ar
        phases.update(
            lockstep_ms=med["lockstep"] * 1e3,
            allreduce_ms=t_ar * 1e3,
            limit_ms=limit * 1e3,
            vs_limit=t_ddp / limit,
            torch_vs_limit=t_torch / limit,
        )
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
        **phases,
    )
    ddp.close()
    return row
