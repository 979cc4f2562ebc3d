"""fully_shard (ZeRO-3): nccl_ddp's against torch's (FSDP2 over gloo), step time and memory per rank.

    python scripts/bench_fsdp.py --worlds 2,4 --layers 8 --dim 512 --steps 5 --rounds 3

A GPT-shaped stack (token embedding, `--layers` blocks of LayerNorm + MLP with a residual, a
norm and an output head), sharded per block and then at the root as FSDP2's recipe does, AdamW,
on rank-dependent tokens; each mode runs as its own job (nccl-ddp-run, one BLAS thread per rank),
torch.distributed on gloo in both (torch's collectives for torch's mode, our host backend for
ours). Per rank (largest over the ranks): the median step time of the slowest rank, peak RSS
(ru_maxrss: counts every page mapped, the peers' shared buffers included) and PSS after the
steps (shared pages split among the ranks that map them), the sharded state (parameters + grads
+ AdamW state held as shards) and, for ours, per step the gathers started, the comm stream's
time from each gather's start to its copy-out's end, the part of it the compute thread waited
for (exposed: not hidden behind compute by the prefetch), and per unit the wall and CPU time of
its hooks apart from those waits (the Python overhead). The modes' jobs alternate within each of
`--rounds` (medians kept: the machine may be shared); a second table puts each mode next to
torch's with the ratios, and both go to CSV. `--base DIR` adds mode `base`: ours from another
checkout, for a before/after in one run. `--profile N`: rank 0's top N functions (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
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
from benchlib import format_table, init_torch_pg, run_ranks, write_csv  # noqa: E402

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
    "gathers",
    "gather_ms",
    "exposed_gather_ms",
    "hidden_pct",
    "hooks_us_per_unit",
    "hooks_cpu_us_per_unit",
]
FORMATS = {
    "params_M": ".2f",
    "step_ms": ".1f",
    "vs_torch": ".2f",
    "peak_rss_MiB": ".0f",
    "pss_MiB": ".0f",
    "sharded_MiB": ".1f",
    "gathers": ".0f",
    "gather_ms": ".1f",
    "exposed_gather_ms": ".1f",
    "hidden_pct": ".0f",
    "hooks_us_per_unit": ".0f",
    "hooks_cpu_us_per_unit": ".0f",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2", help="comma-separated world sizes")
    p.add_argument("--modes", default="torch,ours", help="torch, ours, base (ours from --base)")
    p.add_argument("--base", help="another checkout of nccl_ddp for mode 'base' (before/after)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reshard-after-forward", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="jobs per mode, interleaved (medians kept)")
    p.add_argument("--csv", default="out/bench_fsdp.csv", help="CSV path ('' for none)")
    p.add_argument("--profile", type=int, default=0, help="N: rank 0's top N functions (cProfile) to stderr")
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
    prof = _Profile(args.profile if nd.get_rank() == 0 else 0)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        if step == args.warmup:
            _reset_unit_times(net)
        with prof.on(step >= args.warmup):
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    prof.report(f"{args.mode}, {nd.get_world_size()} ranks, rank 0, {args.steps} steps")
    if prof.prof is not None:
        _print_units(net, args.steps)
    row = dict(
        world=nd.get_world_size(),
        mode=args.mode,
        params_M=n_params / 1e6,
        step_ms=statistics.median(times) * 1e3,
        peak_rss_MiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB,
        pss_MiB=rss_trimmed() / MiB,
        sharded_MiB=_sharded_bytes(net, opt) / MiB,
        **_unit_times(net, args.steps),
    )
    rows: list = [None] * nd.get_world_size()
    torch.distributed.all_gather_object(rows, row)
    if nd.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    torch.distributed.destroy_process_group()
    nd.destroy_process_group()


class _Profile:
    """cProfile over the timed steps of one rank's compute thread, in CPU time (the comm thread
    is not seen: its share shows in the gather time), its top `top` functions by own time."""

    def __init__(self, top: int) -> None:
        import cProfile

        # the thread's CPU time, not the wall clock: waits for the GIL or a core are not counted
        self.top, self.prof = top, cProfile.Profile(time.thread_time) if top else None

    @contextlib.contextmanager
    def on(self, timed: bool):
        if self.prof is None or not timed:
            yield
            return
        self.prof.enable()
        try:
            yield
        finally:
            self.prof.disable()

    def report(self, what: str) -> None:
        if self.prof is not None:
            import pstats

            print(f"# cProfile of the timed steps: {what}", file=sys.stderr)
            pstats.Stats(self.prof, stream=sys.stderr).sort_stats(
                os.environ.get("BENCH_FSDP_SORT", "tottime")
            ).print_stats(self.top)


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


def _units(net) -> list:
    from nccl_ddp.adapters.torch.fsdp.unit import Unit

    found = {
        id(u): u for m in net.modules() if isinstance(u := getattr(m, "_nccl_ddp_fsdp_unit", None), Unit)
    }
    return list(found.values())


def _reset_unit_times(net) -> None:
    """Ours: the units' counters from zero (the timed steps only)."""
    from nccl_ddp.adapters.torch.fsdp.unit import UnitTimes

    for u in _units(net):
        u.times = UnitTimes()
        if hasattr(u.shards, "gather_s"):  # (not in older trees, for --base)
            u.shards.gather_s = 0.0


def _print_units(net, steps: int) -> None:
    """Ours, with --profile: per unit and step, its gathers, their comm time and the exposed part
    (in forward order; the first unit's forward gather has nothing to hide behind)."""
    units = _units(net)
    if units and hasattr(units[0].shards, "gather_s"):
        order = {u: k for k, u in enumerate(units[0].schedule.forward_order)}
        print(
            "# per unit and step: gathers, gather_ms (comm), exposed_ms (waited), hooks_cpu_us",
            file=sys.stderr,
        )
        for u in sorted(units, key=lambda u: order.get(u, len(order))):
            t = u.times
            print(
                f"#   {u.name:>20}  {t.gathers / steps:4.1f}  {u.shards.gather_s * 1e3 / steps:7.2f}  "
                f"{t.waited_s * 1e3 / steps:7.2f}  {getattr(t, 'hooks_cpu_s', 0.0) * 1e6 / steps:7.0f}",
                file=sys.stderr,
            )


def _unit_times(net, steps: int) -> dict:
    """Ours, per step: the gathers started, the comm stream's time from each gather's start to
    its copy-out's end (gather_ms, all units), the part of it the compute thread waited for
    (exposed), and the hooks' Python time per unit apart from those waits ('' for torch's)."""
    units = _units(net)
    keys = (
        "units",
        "gathers",
        "gather_ms",
        "exposed_gather_ms",
        "hooks_us_per_unit",
        "hooks_cpu_us_per_unit",
    )
    if not units:
        return dict.fromkeys(keys, "")
    per = len(units) * steps
    have = all(hasattr(u.shards, "gather_s") for u in units)  # (older trees lack these, --base)
    cpu = all(hasattr(u.times, "hooks_cpu_s") for u in units)
    return {
        "units": len(units),
        "gathers": sum(u.times.gathers for u in units) / steps,
        "gather_ms": sum(u.shards.gather_s for u in units) * 1e3 / steps if have else "",
        "exposed_gather_ms": sum(u.times.waited_s for u in units) * 1e3 / steps,
        "hooks_us_per_unit": sum(u.times.hooks_s for u in units) * 1e6 / per,
        "hooks_cpu_us_per_unit": sum(u.times.hooks_cpu_s for u in units) * 1e6 / per if cpu else "",
    }


def table_rows(raw: list) -> list:
    """Per (world, mode): the largest memory and step time over the ranks (then the median step
    and the largest memory over the rounds), the step against torch's."""
    rows = []
    for world in sorted({r["world"] for r in raw}):
        for mode in dict.fromkeys(r["mode"] for r in raw if r["world"] == world):
            rs = [r for r in raw if r["world"] == world and r["mode"] == mode]
            rounds = sorted({r.get("round", 0) for r in rs})
            per_round = [[r for r in rs if r.get("round", 0) == k] for k in rounds]
            top = dict(rs[0])
            top["step_ms"] = statistics.median(max(r["step_ms"] for r in rr) for rr in per_round)
            for key in ("peak_rss_MiB", "pss_MiB", "sharded_MiB"):
                top[key] = max(r[key] for r in rs)
            for key in ("gather_ms", "exposed_gather_ms", "hooks_us_per_unit", "hooks_cpu_us_per_unit"):
                if top.get(key, "") != "":
                    top[key] = statistics.median(max(r[key] for r in rr) for rr in per_round)
            if top.get("gather_ms"):
                top["hidden_pct"] = 100.0 * (1.0 - top["exposed_gather_ms"] / top["gather_ms"])
            top["rounds"] = len(rounds)
            top.pop("round", None)
            rows.append(top)
        ref = next((r["step_ms"] for r in rows if r["world"] == world and r["mode"] == "torch"), None)
        for r in rows:
            if r["world"] == world:
                r["vs_torch"] = r["step_ms"] / ref if ref else ""
    return rows


SIDE_BY_SIDE = [
    "world",
    "mode",
    "torch_step_ms",
    "step_ms",
    "step_ratio",
    "torch_pss_MiB",
    "pss_MiB",
    "pss_ratio",
    "torch_peak_rss_MiB",
    "peak_rss_MiB",
    "rss_ratio",
    "hidden_pct",
    "hooks_cpu_us_per_unit",
    "load",
]


def side_by_side(rows: list) -> list:
    """Per world, each mode other than torch's next to torch's: step time and memory, and the
    ratios mode / torch."""
    out = []
    for r in rows:
        ref = next((t for t in rows if t["world"] == r["world"] and t["mode"] == "torch"), None)
        if r["mode"] == "torch" or ref is None:
            continue
        row = {k: r.get(k, "") for k in ("world", "mode", "hidden_pct", "hooks_cpu_us_per_unit", "load")}
        for key, ratio in (
            ("step_ms", "step_ratio"),
            ("pss_MiB", "pss_ratio"),
            ("peak_rss_MiB", "rss_ratio"),
        ):
            row[f"torch_{key}"], row[key] = ref[key], r[key]
            row[ratio] = r[key] / ref[key] if ref[key] else ""
        out.append(row)
    return out


def _sbs_formats() -> dict:
    fmt = {c: (".2f" if c.endswith("ratio") else ".1f" if "step" in c else ".0f") for c in SIDE_BY_SIDE}
    fmt.update(load=".2f")
    fmt.pop("world")
    return fmt


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _jobs(args, argv: list) -> list:
    """Every (round, world, mode) as its own nccl-ddp-run job, the modes interleaved within a
    round; their ranks' rows ([] if one failed). Mode `base` runs ours from `--base`'s tree."""
    raw: list = []
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        for rnd in range(args.rounds):
            for world in [int(w) for w in args.worlds.split(",")]:
                for mode in args.modes.split(","):
                    out = os.path.join(tmp, f"{rnd}-{world}-{mode}.json")
                    env = None
                    if mode == "base":
                        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.base))
                    rc = run_ranks(__file__, world, argv + ["--mode", mode, "--out", out], args.timeout, env)
                    if rc != 0:
                        print(f"# world {world} {mode}: the job failed (exit {rc})", file=sys.stderr)
                        return []
                    with open(out) as f:
                        got = json.load(f)
                    load = _load()
                    raw += [dict(r, round=rnd, load=load) for r in got]
    return raw


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode:  # a worker of one job
        worker(args)
        return 0
    if "base" in args.modes.split(",") and not args.base:
        print("bench_fsdp: mode 'base' needs --base DIR (another checkout of nccl_ddp)", file=sys.stderr)
        return 2
    load0 = _load()
    raw = _jobs(args, list(sys.argv[1:] if argv is None else argv))
    if not raw:
        return 1
    rows = table_rows(raw)
    print(
        f"# bench_fsdp {date.today()}: {rows[0]['params_M']:.2f}M fp32 params, {args.layers} blocks "
        f"of dim {args.dim}, AdamW, batch {args.batch}x{args.seq}/rank, {args.steps} steps after "
        f"{args.warmup}, reshard_after_forward={bool(args.reshard_after_forward)}, {args.rounds} "
        f"round(s) interleaved; per rank, largest over the ranks (step: median over the rounds); "
        f"load average {load0:.2f} before, {_load():.2f} after"
    )
    print(format_table(rows, COLUMNS, FORMATS))
    sbs = side_by_side(rows)
    if sbs:
        print("# side by side: ratios are mode / torch (lower is faster / less memory); load: 1-min average")
        print(format_table(sbs, SIDE_BY_SIDE, _sbs_formats()))
    if args.csv:
        write_csv(rows, args.csv)
        if sbs:
            write_csv(sbs, args.csv.replace(".csv", "_vs_torch.csv"))
        print(f"# wrote {args.csv}" + (f" and {args.csv.replace('.csv', '_vs_torch.csv')}" if sbs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
