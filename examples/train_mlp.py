"""Data-parallel training of an MLP with hand-written backprop: the main job.

    nccl-ddp-run --nproc-per-node 2 examples/train_mlp.py [--steps 40]

NumPy on the host backend, CuPy on GPUs (NCCL). Each rank trains on its own shard of a synthetic
regression task (a fixed random "teacher" MLP labels the inputs, seeded, so every run is the same).
The model is wrapped in `DistributedDataParallel`; backward hands each layer's grads to its hook
as soon as they are computed, last layer first, so the all-reduce of the last layers' bucket runs
while the earlier layers are still being differentiated. Plain SGD. Rank 0 prints the loss (the
mean over all ranks) per step; at the end every rank compares parameter checksums and the job
exits non-zero unless all ranks hold identical parameters and the loss went down.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import nccl_ddp as nd
from nccl_ddp.adapters.arrays import ArrayModule


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="hidden layers")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.25,
        help="small buckets so several all-reduces overlap backward",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def init_params(xp, dims, seed):
    """LeCun-initialised weights; seeded by rank on purpose: DDP's init_sync copies rank 0's."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (n_in, n_out) in enumerate(zip(dims[:-1], dims[1:])):
        params[f"W{i}"] = xp.asarray(
            rng.standard_normal((n_in, n_out)) * np.sqrt(1.0 / n_in), dtype=xp.float32
        )
        params[f"b{i}"] = xp.zeros(n_out, dtype=xp.float32)
    return params


def forward(params, x):
    """Returns every layer's input (kept for backward) and the output."""
    n = len(params) // 2
    acts = [x]
    for i in range(n):
        z = acts[-1] @ params[f"W{i}"] + params[f"b{i}"]
        acts.append(z if i == n - 1 else z * (z > 0))
    return acts


def backward(params, acts, dout, hooks):
    """Backprop layer by layer, last first; each layer's grads go to their DDP hooks at once."""
    delta = dout
    for i in reversed(range(len(params) // 2)):
        hooks[f"W{i}"](acts[i].T @ delta)
        hooks[f"b{i}"](delta.sum(axis=0))
        if i:
            delta = (delta @ params[f"W{i}"].T) * (acts[i] > 0)


def make_data(xp, args, world):
    """The whole synthetic dataset (identical on every rank): inputs and teacher labels."""
    rng = np.random.default_rng(args.seed + 12345)
    n = args.batch * world * 8
    x = rng.standard_normal((n, args.features)).astype(np.float32)
    teacher = init_params(np, [args.features, 64, 1], args.seed + 999)
    y = forward(teacher, x)[-1]
    return xp.asarray(x), xp.asarray(y)


def main(argv=None) -> int:
    args = parse_args(argv)
    group = nd.init_process_group()
    rank, world = nd.get_rank(), nd.get_world_size()
    if group.backend == "nccl":
        import cupy as xp

        xp.cuda.Device(group.device_id).use()  # the GPU the NCCL group runs on
    else:
        xp = np
    dims = [args.features] + [args.hidden] * args.layers + [1]
    model = ArrayModule(init_params(xp, dims, args.seed + rank), forward=forward)
    ddp = nd.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    hooks = {k: ddp.grad_hook(k) for k in model.keys}
    x_all, y_all = make_data(xp, args, world)
    per_step = args.batch * world
    losses = []
    for step in range(args.steps):
        start = (step * per_step) % x_all.shape[0] + rank * args.batch  # this rank's shard
        x, y = x_all[start : start + args.batch], y_all[start : start + args.batch]
        acts = ddp(x)
        err = acts[-1] - y
        backward(model.params, acts, 2.0 * err / err.size, hooks)  # d(mean squared error)
        for k in model.keys:  # grads are averaged now
            model.params[k] -= args.lr * model.grads[k]
        ddp.zero_grad()
        loss = xp.asarray([float((err * err).mean())], dtype=xp.float64)
        nd.all_reduce(loss, op="avg")
        losses.append(float(loss[0]))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    ok = check_identical(xp, model, rank, world)
    k = max(1, len(losses) // 5)  # mean of the first vs the last fifth of the steps
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    went_down = last < first
    if rank == 0:
        print(
            f"loss {first:.6f} -> {last:.6f} (first/last {k} steps: {'down' if went_down else 'NOT down'})",
            flush=True,
        )
    ddp.close()
    nd.destroy_process_group()
    return 0 if ok and went_down else 1


def check_identical(xp, model, rank, world) -> bool:
    """All-gather one float64 checksum per parameter; every rank must see identical rows."""
    sums = xp.asarray(
        [
            float(xp.abs(model.params[k]).astype(xp.float64).sum())
            + float((model.params[k].astype(xp.float64) ** 2).sum())
            for k in model.keys
        ]
    )
    gathered = xp.empty(world * sums.size, dtype=xp.float64)
    nd.get_world_group().all_gather(gathered, sums).wait()
    rows = np.asarray(gathered.get() if hasattr(gathered, "get") else gathered).reshape(world, -1)
    same = bool((rows == rows[0]).all())
    if rank == 0:
        print(
            f"{'all' if same else 'NOT all'} {world} ranks hold identical parameters "
            f"({'identical' if same else 'different'} checksums of {sums.size} arrays)",
            flush=True,
        )
    return same


if __name__ == "__main__":
    sys.exit(main())
