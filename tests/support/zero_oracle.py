"""The reference runs the sharded optimizer is held to (tests/adapters/torch_tests/zero/test_zero_torch.py):
one model with
uneven parameter sizes (shards cut through parameters, a 1-element parameter, several buckets),
rank-dependent data, 10 steps; torch DDP on gloo with an unsharded torch optimizer (or torch's own
ZeroRedundancyOptimizer) against ours."""

from __future__ import annotations

import contextlib
import os

import numpy as np

STEPS, BATCH, IN, OUT = 10, 6, 7, 3


def make_model(dtype=None):
    import torch

    class Uneven(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(IN, 13)  # 91 + 13
            self.b = torch.nn.Linear(13, 11)  # 143 + 11
            self.c = torch.nn.Linear(11, OUT)  # 33 + 3
            self.gain = torch.nn.Parameter(torch.tensor([1.5]))

        def forward(self, x, use_gain: bool = True):
            out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
            return out * self.gain if use_gain else out

    torch.manual_seed(7)
    m = Uneven()
    return m if dtype is None else m.to(dtype)


def global_batches(steps: int = STEPS):
    import torch

    g = np.random.default_rng(3)
    return [
        (
            torch.from_numpy(g.standard_normal((BATCH, IN), dtype=np.float32)),
            torch.from_numpy(g.standard_normal((BATCH, OUT), dtype=np.float32)),
        )
        for _ in range(steps)
    ]


def local(batch, rank: int, world: int):
    """This rank's equal share of a global batch (so every world size trains the same)."""
    n = BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


OPTIMIZERS = {
    "adamw": ("AdamW", {"lr": 0.02, "weight_decay": 0.1}),
    "sgd": ("SGD", {"lr": 0.05, "momentum": 0.9}),
}


def train(
    model,
    opt,
    wrapped,
    rank: int,
    world: int,
    *,
    clip=None,
    steps=None,
    start=0,
    dtype=None,
    accumulate: int = 1,
) -> dict:
    """`accumulate` > 1: the local batch in that many micro-batches, all but the last under
    `no_sync()`."""
    import contextlib

    import torch

    data = global_batches()
    for step in range(start, STEPS if steps is None else start + steps):
        x, y = local(data[step], rank, world)
        if dtype is not None:
            x = x.to(dtype)
        opt.zero_grad()
        for k, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            last = k == accumulate - 1
            with contextlib.nullcontext() if last else wrapped.no_sync():
                loss = torch.nn.functional.mse_loss(wrapped(xm).float(), ym) / accumulate
                loss.backward()
        if clip is not None:
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return params_of(model)


def params_of(model) -> dict:
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def train_masters(model, wrapped, rank: int, world: int, name: str, reduce_fp32: bool = False) -> dict:
    """The unsharded bf16 reference: an fp32 master copy per parameter stepped by the torch
    optimizer on the reduced grads widened to fp32, written back rounded to the model's dtype.
    `reduce_fp32`: `wrapped` is the bare model, each rank's grads are widened first and then
    averaged by a torch.distributed all-reduce (the reference of reduce_dtype=float32)."""
    import torch

    cls, kw = OPTIMIZERS[name]
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = getattr(torch.optim, cls)(masters, **kw)
    data = global_batches()
    for step in range(STEPS):
        x, y = local(data[step], rank, world)
        for p in model.parameters():
            p.grad = None
        loss = torch.nn.functional.mse_loss(wrapped(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            if reduce_fp32:
                torch.distributed.all_reduce(m.grad)
                m.grad /= world
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return params_of(model)


@contextlib.contextmanager
def host_alone(monkeypatch):
    """nccl_ddp's host group of this process alone (world size 1, on a free port), torn down;
    yields nccl_ddp."""
    from mp import free_port

    import nccl_ddp as nd

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    nd.init_process_group("host", rank=0, world_size=1)
    try:
        yield nd
    finally:
        nd.destroy_process_group()


@contextlib.contextmanager
def gloo_and_host(rank: int, world: int, store_dir: str):
    """torch.distributed on gloo (the reference's) and nccl_ddp's host group, both torn down."""
    import torch
    import torch.distributed as dist

    import nccl_ddp as nd

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(store_dir, 'gloo')}", rank=rank, world_size=world
    )
    nd.init_process_group("host")
    try:
        yield
    finally:
        nd.destroy_process_group()
        dist.destroy_process_group()
