#!/usr/bin/env python3
"""torch DDP on CUDA as the oracle of ours, at world size 1 (one GPU holds one NCCL rank).

    python -m nccl_ddp.launch --nproc-per-node 1 scripts/gpu_torch_oracle.py [--steps 20]
        [--json out.json] [--csv out.csv]

The same BatchNorm CNN (a frozen first conv, BatchNorm running statistics and counters as
buffers), the same data and bf16 autocast, trained `--steps` SGD-momentum steps three times from
one initial state: without DDP, under torch.nn.parallel.DistributedDataParallel on the nccl
backend, and under ours on our nccl backend. Parameters and buffers of torch's and ours must be
equal bit for bit (deterministic cuDNN/cuBLAS). Then the step time of each (median of
`--time-steps` after a warm-up) and the DDP overhead against the loop without DDP.
At world size 1 the all-reduce is an identity: this proves the CUDA data path (hooks, buckets,
pack/unpack kernels, streams, NCCL calls) and its cost, not the reduction across GPUs.
`--cpu` runs the same on the CPU (gloo and our host backend, bf16 autocast on the CPU), to test
the script itself without a GPU. Exit status: 0 equal, 1 a difference or an error.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Optional, Sequence

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts


def make_model(torch: Any) -> Any:
    from torch import nn

    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(512, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    model[0].requires_grad_(False)  # a frozen layer: no grad, no bucket slot
    return model


def batches(torch: Any, n: int, device: Any) -> list:
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randn(32, 3, 16, 16, generator=g).to(device),
            torch.randint(0, 10, (32,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def train(torch: Any, wrapped: Any, module: Any, data: list) -> None:
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    for x, y in data:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def state(module: Any) -> dict:
    out = {n: t.detach().cpu().clone() for n, t in module.named_parameters()}
    out.update({n: t.detach().cpu().clone() for n, t in module.named_buffers()})
    return out


def compare(torch: Any, a: dict, b: dict) -> list:
    """Names whose bytes differ (dtype, shape or any bit)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(
                x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8)
            )
        ):
            bad.append(k)
    return bad


def step_ms(torch: Any, wrapped: Any, module: Any, data: list, warmup: int) -> float:
    sync = torch.cuda.synchronize if data[0][0].is_cuda else (lambda: None)
    train(torch, wrapped, module, data[:warmup])
    times = []
    for item in data[warmup:]:
        sync()
        t0 = time.perf_counter()
        train(torch, wrapped, module, [item])
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_group(dist: Any, backend: str) -> None:
    """torch.distributed with its own rendezvous port (ours holds MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--time-steps", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--csv")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, host backend)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.cpu:
        device = torch.device("cpu")
        nd.init_process_group("host", timeout=60.0)
        torch_group(dist, "gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        nd.init_process_group("nccl", timeout=60.0)
        torch_group(dist, "nccl")
    ids = None if args.cpu else [device.index]
    res: dict = {"steps": args.steps, "world_size": nd.get_world_size()}
    try:
        base = make_model(torch).to(device)
        data = batches(torch, args.steps, device)
        runs = {}
        for mode in ("plain", "torch_ddp", "ours"):
            module = copy.deepcopy(base)
            wrapped = (
                module
                if mode == "plain"
                else TorchDDP(module, device_ids=ids)
                if mode == "torch_ddp"
                else nd.DistributedDataParallel(module)
            )
            train(torch, wrapped, module, data)
            runs[mode] = state(module)  # .cpu() waits for the GPU
        res["keys"] = len(runs["ours"])
        res["differ_from_torch_ddp"] = compare(torch, runs["torch_ddp"], runs["ours"])
        res["torch_ddp_differs_from_plain"] = compare(torch, runs["plain"], runs["torch_ddp"])
        res["equal"] = not res["differ_from_torch_ddp"]
        timing = batches(torch, args.time_steps + 5, device)
        res["step_ms"] = {}
        for mode in ("plain", "torch_ddp", "ours"):
            module = copy.deepcopy(base)
            wrapped = (
                module
                if mode == "plain"
                else TorchDDP(module, device_ids=ids)
                if mode == "torch_ddp"
                else nd.DistributedDataParallel(module)
            )
            res["step_ms"][mode] = step_ms(torch, wrapped, module, timing, 5)
        plain = res["step_ms"]["plain"]
        res["overhead_pct"] = {
            m: 100.0 * (v / plain - 1.0) for m, v in res["step_ms"].items() if m != "plain"
        }
    finally:
        dist.destroy_process_group()
        nd.destroy_process_group()
    print(
        f"oracle: {res['keys']} parameters+buffers after {args.steps} steps, ours vs torch DDP "
        f"{'EQUAL bit for bit' if res['equal'] else 'DIFFER: ' + ', '.join(res['differ_from_torch_ddp'])}"
        f"; torch DDP vs no DDP {'equal' if not res['torch_ddp_differs_from_plain'] else 'differ'}"
    )
    print(
        "step ms: "
        + "  ".join(f"{m} {v:.3f}" for m, v in res["step_ms"].items())
        + "  overhead vs no DDP: "
        + "  ".join(f"{m} {v:+.1f}%" for m, v in res["overhead_pct"].items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mode", "step_ms", "overhead_pct", "equal_to_torch_ddp"])
            for m, v in res["step_ms"].items():
                w.writerow(
                    [
                        m,
                        f"{v:.4f}",
                        f"{res['overhead_pct'].get(m, 0.0):.2f}",
                        "" if m == "plain" else (m == "torch_ddp" or res["equal"]),
                    ]
                )
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
