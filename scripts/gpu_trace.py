#!/usr/bin/env python3
"""A CUPTI timeline of a few DDP steps, through torch.profiler (nsys is not on the GPU machine).

    python -m nccl_ddp.launch --nproc-per-node 1 scripts/gpu_trace.py --out trace.json
    python scripts/overlap_report.py trace.json

Our DistributedDataParallel on the nccl backend over a 12-layer MLP (about 12 MiB of fp32
parameters) with `--bucket-mb` 2 (several buckets), trained `--steps` steps with the bf16
compression hook (so every bucket is packed into a bf16 wire buffer and unpacked after NCCL:
nd_pack/nd_unpack launches on the comm stream), after `--warmup` steps outside the profile.
The Chrome trace holds the kernels with their streams ("cat": "kernel", args.stream); the
report measures how much of the comm stream's time hides behind the backward's kernels.
`--cpu` runs the same on the CPU (host backend; a trace without kernels) to test the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="Chrome trace JSON to write")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import nccl_ddp as nd
    from nccl_ddp import hooks

    if args.cpu:
        device = torch.device("cpu")
        nd.init_process_group("host", timeout=60.0)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        nd.init_process_group("nccl", timeout=60.0)
    try:
        torch.manual_seed(0)
        layers = []
        for _ in range(12):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).to(device)
        ddp = nd.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        ddp.register_comm_hook(None, hooks.bf16_compress)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(256, args.width, device=device)

        def step() -> None:
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

        sync = torch.cuda.synchronize if not args.cpu else (lambda: None)
        for _ in range(args.warmup):
            step()
        sync()
        acts = [ProfilerActivity.CPU] + ([] if args.cpu else [ProfilerActivity.CUDA])
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            sync()
        prof.export_chrome_trace(args.out)
        params = sum(p.numel() for p in model.parameters())
        print(
            f"trace: {args.steps} steps, {params * 4 / 2**20:.1f} MiB of parameters, bucket cap "
            f"{args.bucket_mb:g} MiB, written to {args.out}"
        )
    finally:
        nd.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
