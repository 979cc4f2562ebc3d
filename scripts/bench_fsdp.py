"""fully_shard (ZeRO-3): nccl_ddp's against torch's (FSDP2 over gloo), step time and memory per rank.

    python scripts/bench_fsdp.py --worlds 2,4 --layers 8 --dim 512 --steps 5

A GPT-shaped stack (token embedding, `--layers` blocks of LayerNorm + MLP with a residual, a
norm and an output head), sharded per block and then at the root as FSDP2's recipe does, AdamW,
on rank-dependent tokens; each mode runs as its own job (nccl-ddp-run, one BLAS thread per rank),
torch.distributed on gloo in both (torch's collectives for torch's mode, our host backend for
ours). Per rank (largest over the ranks): the median step time of the slowest rank, peak RSS
(ru_maxrss: counts every page mapped, the peers' shared buffers included) and PSS after the
steps (shared pages split among the ranks that map them), the sharded state (parameters + grads
+ AdamW state held as shards) and, for ours, per unit and step the all-gather wait the compute
thread saw (exposed: not hidden behind compute by the prefetch), the gathers started, and the
Python time of the unit's hooks apart from those waits.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import rss_trimmed  # noqa: E402
from benchlib import format_table, init_torch_pg, run_ranks  # noqa: E402

MiB = 1 << 20
COLUMNS = [
    "world",
    "mode",
    "params_M",
    "step_ms",
    "vs_torch",
    "peak_rss_MiB",
    "pss_MiB",
    "sharded_MiB",
    "units",
    "exposed_gather_ms_per_unit",
    "hooks_us_per_unit",
]
FORMATS = {
    "params_M": ".2f",
    "step_ms": ".1f",
    "vs_torch": ".2f",
    "peak_rss_MiB": ".0f",
    "pss_MiB": ".0f",
    "sharded_MiB": ".1f",
    "exposed_gather_ms_per_unit": ".2f",
    "hooks_us_per_unit": ".0f",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2", help="comma-separated world sizes")
    p.add_argument("--modes", default="torch,ours")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reshard-after-forward", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--mode", help=argparse.SUPPRESS)  # a worker: torch | ours
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model(args):
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(args.dim)
            self.up = torch.nn.Linear(args.dim, 4 * args.dim)
            self.down = torch.nn.Linear(4 * args.dim, args.dim)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(args.vocab, args.dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = torch.nn.LayerNorm(args.dim)
            self.head = torch.nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, ids):
            h = self.tok(ids)
            for b in self.blocks:
                h = b(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return GPT()


def worker(args) -> None:
    import torch

    import nccl_ddp as nd

    torch.set_num_threads(1)
    nd.init_process_group("host")
    init_torch_pg(nd, torch, "gloo")
    if args.mode == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = nd.fully_shard
    net = model(args)
    n_params = sum(p.numel() for p in net.parameters())
    for b in net.blocks:
        fully_shard(b, reshard_after_forward=bool(args.reshard_after_forward))
    fully_shard(net, reshard_after_forward=bool(args.reshard_after_forward))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(nd.get_rank())
    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    row = dict(
        world=nd.get_world_size(),
        mode=args.mode,
        params_M=n_params / 1e6,
        step_ms=statistics.median(times) * 1e3,
        peak_rss_MiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB,
        pss_MiB=rss_trimmed() / MiB,
        sharded_MiB=_sharded_bytes(net, opt) / MiB,
        **_unit_times(net, args.warmup + args.steps),
    )
    rows: list = [None] * nd.get_world_size()
    torch.distributed.all_gather_object(rows, row)
    if nd.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    torch.distributed.destroy_process_group()
    nd.destroy_process_group()


def _sharded_bytes(net, opt) -> int:
    """Bytes this rank holds as shards: parameters, grads and AdamW state (their local tensors)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = 0
    for p in net.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for state in opt.state.values():
        total += sum(local(v).nbytes for v in state.values() if hasattr(v, "nbytes") and v.dim() > 0)
    return total


def _unit_times(net, steps: int) -> dict:
    """Ours: the exposed all-gather wait and hook time per unit and step ('' for torch's)."""
    from nccl_ddp.adapters.torch.fsdp.unit import Unit

    units = [u for m in net.modules() if isinstance(u := getattr(m, "_nccl_ddp_fsdp_unit", None), Unit)]
    if not units:
        return {"units": "", "exposed_gather_ms_per_unit": "", "hooks_us_per_unit": ""}
    per = len(units) * steps
    return {
        "units": len(units),
        "exposed_gather_ms_per_unit": sum(u.times.waited_s for u in units) * 1e3 / per,
        "hooks_us_per_unit": sum(u.times.hooks_s for u in units) * 1e6 / per,
    }


def table_rows(raw: list) -> list:
    """Per (world, mode): the largest memory and step time over the ranks, step vs torch's."""
    rows = []
    for world in sorted({r["world"] for r in raw}):
        for mode in dict.fromkeys(r["mode"] for r in raw if r["world"] == world):
            rs = [r for r in raw if r["world"] == world and r["mode"] == mode]
            top = dict(rs[0])
            for key in ("step_ms", "peak_rss_MiB", "pss_MiB", "sharded_MiB"):
                top[key] = max(r[key] for r in rs)
            rows.append(top)
        ref = next((r["step_ms"] for r in rows if r["world"] == world and r["mode"] == "torch"), None)
        for r in rows:
            if r["world"] == world:
                r["vs_torch"] = r["step_ms"] / ref if ref else ""
    return rows


def _jobs(args, argv: list) -> list:
    """Every (world, mode) as its own nccl-ddp-run job; their ranks' rows (None if one failed)."""
    raw: list = []
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            for mode in args.modes.split(","):
                out = os.path.join(tmp, f"{world}-{mode}.json")
                rc = run_ranks(__file__, world, argv + ["--mode", mode, "--out", out], args.timeout)
                if rc != 0:
                    print(f"# world {world} {mode}: the job failed (exit {rc})", file=sys.stderr)
                    return []
                with open(out) as f:
                    raw += json.load(f)
    return raw


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode:  # a worker of one job
        worker(args)
        return 0
    raw = _jobs(args, list(sys.argv[1:] if argv is None else argv))
    if not raw:
        return 1
    rows = table_rows(raw)
    print(
        f"# bench_fsdp {date.today()}: {rows[0]['params_M']:.2f}M fp32 params, {args.layers} blocks "
        f"of dim {args.dim}, AdamW, batch {args.batch}x{args.seq}/rank, {args.steps} steps after "
        f"{args.warmup}, reshard_after_forward={bool(args.reshard_after_forward)}; "
        "per rank, largest over the ranks"
    )
    print(format_table(rows, COLUMNS, FORMATS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
