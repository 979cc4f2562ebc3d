#!/usr/bin/env python
"""All-reduce bandwidth, nccl-tests style, with torch.distributed gloo beside it when torch is
installed (same processes, same sizes, same moment).

    python scripts/bench_allreduce.py                     # spawns 2 ranks itself
    python scripts/bench_allreduce.py --nranks 3 --min 1M --max 64M --dtype float16
    nccl-ddp-run --nproc-per-node 2 scripts/bench_allreduce.py --backend host

busbw = algbw * 2(n-1)/n (the bytes each rank's link must carry in a ring). Times are the
slowest rank's mean over the iterations, the median of --rounds interleaved rounds (ours, shared,
limit, gloo, then again). Rank 0 prints the table and writes the CSV.

`limit` (host backend, from --limit-min up, 16 MiB by default): the copy+add limit of this
machine, measured in the same processes right after ours at each size: every rank at once adds
the n-1 other ranks' share of its 1/n part into it (NumPy add, the reduction's own work) and
copies the other (n-1)/n back (NumPy copy, what an all-gather must write), from arrays of its
own; `vs_limit` = limit time / ours (1.0: ours moves data as fast as that bare NumPy work).
The all-reduce on shared buffers does less than that: each rank reads its part of every rank's
buffer and writes its result into all of them, 256 KiB at a time (the piece it writes is still
in its cache: no copy reads it back from memory), so it can pass the copy+add limit. `work`:
that same memory work alone, on arrays of each rank's own, every rank at once;
`shared_vs_work` = work time / shared time (1.0: no cost for signals or for another
process's memory).

Private arrays (host shm, above 64 KiB) run in place through a shared twin (comm/host/twins.py:
NumPy's own buffers adopted into shared memory where they lie, others mirrored). `time_us` /
`busbw_GBps` are ours on one private NumPy array reused every call (`reused_vs_shared` = shared
time / that time); `first_*`: a fresh private array every call (allocated and filled untimed),
its twin made in the call; `staged_*`: the private array with twins off on every rank (the path
every private array took before twins).

`--nodes K`: the spawned ranks form K nodes of one machine (GROUP_RANK, as K launchers would set
it): ours is then the hierarchical all-reduce (comm/host/hier.py), `flat_*` the flat TCP ring on
the same ranks (a second group, NCCL_DDP_HOST_HIERARCHY=0), `vs_flat` = flat time / ours, and
`cross_MiB` / `flat_cross_MiB` the bytes one rank sent between nodes per op (the most of any rank).
With NCCL_DDP_HOST_THROTTLE_BPS set, our links between nodes are paced (gloo's are not).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (  # noqa: E402
    Progress,
    array_module,
    format_table,
    plot_series,
    slowest,
    synchronize,
    timed_steps,
    write_csv,
)

BYTES_PER_SIZE = 1 << 30  # aim to move about this much per size and backend (caps iterations)
COLUMNS = (
    "size",
    "count",
    "dtype",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "gloo_time_us",
    "gloo_busbw_GBps",
    "vs_gloo",
    "flat_busbw_GBps",
    "vs_flat",
    "cross_MiB",
    "flat_cross_MiB",
    "first_busbw_GBps",
    "staged_busbw_GBps",
    "reused_vs_shared",
    "limit_busbw_GBps",
    "vs_limit",
    "shared_time_us",
    "shared_busbw_GBps",
    "shared_vs_limit",
    "work_busbw_GBps",
    "shared_vs_work",
)
FORMATS = {
    "flat_busbw_GBps": ".3f",
    "vs_flat": ".2f",
    "cross_MiB": ".1f",
    "flat_cross_MiB": ".1f",
    "first_busbw_GBps": ".3f",
    "staged_busbw_GBps": ".3f",
    "reused_vs_shared": ".2f",
    "work_busbw_GBps": ".3f",
    "shared_vs_work": ".2f",
    "limit_busbw_GBps": ".3f",
    "vs_limit": ".2f",
    "shared_time_us": ".1f",
    "shared_busbw_GBps": ".3f",
    "shared_vs_limit": ".2f",
    "time_us": ".1f",
    "algbw_GBps": ".3f",
    "busbw_GBps": ".3f",
    "gloo_time_us": ".1f",
    "gloo_busbw_GBps": ".3f",
    "vs_gloo": ".2f",
}


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def parse_args(argv=None) -> argparse.Namespace:
    # @FILE reads arguments from FILE, one per line: a launcher's own parser (torchrun's and ours)
    # refuses --max after the script as an abbreviation of its --max-restarts
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, fromfile_prefix_chars="@"
    )
    p.add_argument("--min", type=_bytes, default=_bytes("1K"), help="smallest size (1K)")
    p.add_argument("--max", type=_bytes, default=_bytes("256M"), help="largest size (256M)")
    p.add_argument("--dtype", default="float32", help="float32, float16, bfloat16, int32, ...")
    p.add_argument("--op", default="sum", help="sum, avg, max, min, prod")
    p.add_argument("--iters", type=int, default=20, help="iterations per size at most (20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size; medians are shown (3)")
    p.add_argument("--backend", default="host", help="host, nccl, or auto (default host)")
    p.add_argument("--nranks", type=int, default=2, help="ranks to spawn without a launcher (2)")
    p.add_argument("--no-gloo", action="store_true", help="skip the torch gloo comparison")
    p.add_argument("--nodes", type=int, default=1, help="nodes the spawned ranks form on this machine (1)")
    p.add_argument(
        "--limit-min",
        type=_bytes,
        default=_bytes("16M"),
        help="measure the copy+add limit from this size up (host backend; 16M: below it the "
        "limit's arrays sit in cache; 0 for never)",
    )
    p.add_argument("--csv", default="out/bench_allreduce.csv", help="CSV path ('' for none)")
    p.add_argument(
        "--png",
        default="out/bench_allreduce.png",
        help="plot of busbw against size, ours beside gloo ('' for none)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    return p.parse_args(argv)


def _sizes(args, itemsize: int) -> list:
    out, s = [], max(args.min, itemsize)
    while s <= args.max:
        out.append(s)
        s *= 2
    return out


def _iters(args, size: int) -> int:
    return max(3, min(args.iters, BYTES_PER_SIZE // size))


def _time_ours(nd, args, x, iters: int, group=None) -> float:
    """Seconds per all-reduce of `x` on `group` (None: the world's; NumPy on host, CuPy on nccl:
    NCCL calls return before the GPU ran them, so the device is synchronised around the loop)."""
    xp = array_module(nd)
    for _ in range(max(2, args.warmup)):  # (a private array's twin is made at its second call)
        nd.all_reduce(x, op=args.op, group=group)
    nd.barrier()
    synchronize(xp)
    t0 = time.perf_counter()
    for _ in range(iters):
        nd.all_reduce(x, op=args.op, group=group)
    synchronize(xp)
    return slowest(nd, (time.perf_counter() - t0) / iters)


def _shared_buffer(nd, count: int, dtype):
    """Ones in the group's shared bucket memory (`ProcessGroup.zeros`: on the host's shm
    transport peers read it in place, as DDP's buckets), or None where the group has none."""
    from nccl_ddp.comm.host.shm import SMALL_BYTES
    from nccl_ddp.device import HostDevice

    group = nd.get_world_group()
    if group.backend != "host" or getattr(group, "transport_kind", "") != "shm":
        return None
    if count * dtype.itemsize <= SMALL_BYTES:  # one signal, no staging: nothing to share
        return None
    out = group.zeros(HostDevice(), count, dtype)
    out[...] = 1
    return out


def _twins(nd, on: bool) -> None:
    """Private arrays get shared twins (adopted or mirrored) on this rank, or not (staged)."""
    from nccl_ddp.comm.host.twins import MIRROR_BYTES

    os.environ["NCCL_DDP_HOST_ADOPT"] = "1" if on else "0"
    nd.get_world_group()._transport.twins.max_bytes = MIRROR_BYTES if on else 0


def _time_staged(nd, args, x, iters: int) -> float:
    _twins(nd, False)
    try:
        return _time_ours(nd, args, x, iters)
    finally:
        _twins(nd, True)


def _time_first(nd, args, x, iters: int) -> float:
    """Seconds per all-reduce of a private array new at every call (allocation and fill untimed):
    its twin is made inside the call."""
    total = 0.0
    for _ in range(iters):
        y = np.ones_like(x)
        nd.barrier()
        t0 = time.perf_counter()
        nd.all_reduce(y, op=args.op)
        total += time.perf_counter() - t0
        del y
    return slowest(nd, total / iters)


def _flat_group(nd):
    """The same ranks on the flat TCP ring, where the world group is hierarchical; else None."""
    if getattr(nd.get_world_group(), "transport_kind", "") != "hier":
        return None
    os.environ["NCCL_DDP_HOST_HIERARCHY"] = "0"
    try:
        return nd.new_group(list(range(nd.get_world_size())))
    finally:
        os.environ["NCCL_DDP_HOST_HIERARCHY"] = "1"


def _time_on(nd, args, x, iters: int, group) -> tuple:
    """(seconds per all-reduce of `x` on `group`, MiB a rank sent between nodes per op, the most
    of any rank: counted over one more call, the bytes of an op being the same every time)."""
    t = _time_ours(nd, args, x, iters, group)
    sent = group.cross_node_bytes()
    nd.all_reduce(x, op=args.op, group=group)
    return t, slowest(nd, (group.cross_node_bytes() - sent) / (1 << 20))


def _time_limit(nd, args, x, iters: int) -> float:
    """Seconds per round of the copy+add limit for `x` on every rank at once: add the n-1 other
    shares of part `rank` into it, copy the rest of `x` from a separate array (see the docstring)."""
    rank, n = nd.get_rank(), nd.get_world_size()
    lo, hi = x.size * rank // n, x.size * (rank + 1) // n
    mine = x[lo:hi]
    shares = [np.ones(hi - lo, x.dtype) for _ in range(n - 1)]  # what the peers hold of my part
    src = np.ones(x.size, x.dtype)  # the reduced parts of the others, to copy back
    add = np.add if x.dtype.kind != "b" else np.logical_or

    def once() -> None:
        for s in shares:
            add(mine, s, out=mine)
        np.copyto(x[:lo], src[:lo])
        np.copyto(x[hi:], src[hi:])

    return timed_steps(nd, once, args.warmup, iters, lambda: None)


def _time_work(nd, args, x, iters: int) -> float:
    """Seconds per round of the shared all-reduce's own memory work on arrays of this rank's own,
    every rank at once: part `rank` of `x` plus the n-1 others' shares of it, 256 KiB at a time,
    each reduced piece then written into those shares (where it goes in the peers' buffers)."""
    from nccl_ddp.comm.host.shm import PIECE_BYTES

    rank, n = nd.get_rank(), nd.get_world_size()
    lo, hi = x.size * rank // n, x.size * (rank + 1) // n
    shares = [np.ones(x.size, x.dtype)[lo:hi] for _ in range(n - 1)]  # the peers' buffers' part
    add = np.add if x.dtype.kind != "b" else np.logical_or
    step = max(1, PIECE_BYTES // x.itemsize)

    def once() -> None:
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            mine = x[a:b]
            for s in shares:
                add(mine, s[a - lo : b - lo], out=mine)
            for s in shares:
                np.copyto(s[a - lo : b - lo], mine)

    return timed_steps(nd, once, args.warmup, iters, lambda: None)


def _gloo_setup(nd, args):
    """torch.distributed on gloo, rendezvous through our own store; None without torch."""
    if args.no_gloo:
        return None
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    port = array_module(nd).zeros(1, np.int64)
    if nd.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    nd.broadcast(port, src=0)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{int(port[0])}", rank=nd.get_rank(), world_size=nd.get_world_size()
    )
    torch.set_num_threads(1)
    return torch, dist


def _time_gloo(nd, gloo, args, x, iters: int):
    torch, dist = gloo
    x = x if isinstance(x, np.ndarray) else x.get()  # gloo on the host copy
    ops = {
        "sum": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "prod": dist.ReduceOp.PRODUCT,
    }
    if args.op not in ops:
        return None
    try:
        t = (
            torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
            if x.dtype.name == "bfloat16"
            else torch.from_numpy(x)
        )
        for _ in range(args.warmup):
            dist.all_reduce(t, op=ops[args.op])
    except RuntimeError:  # a dtype gloo does not reduce
        return None
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, op=ops[args.op])
    return slowest(nd, (time.perf_counter() - t0) / iters)


def worker(args) -> list:
    """Runs on every rank; returns the rows (rank 0 also prints and writes them)."""
    import nccl_ddp as nd

    if args.dtype == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(args.dtype)
    nd.init_process_group(backend=None if args.backend == "auto" else args.backend)
    rank, n = nd.get_rank(), nd.get_world_size()
    gloo = _gloo_setup(nd, args)
    flat = _flat_group(nd)
    sizes = _sizes(args, dtype.itemsize)
    prog = Progress(len(sizes), "bench_allreduce") if rank == 0 else None
    rows = []
    for size in sizes:
        count = size // dtype.itemsize
        x = array_module(nd).asarray(np.ones(count, dtype))
        iters = _iters(args, size)
        shared = _shared_buffer(nd, count, dtype)
        limit = bool(args.limit_min and size >= args.limit_min and nd.get_world_group().backend == "host")
        times: dict = {
            "ours": [],
            "shared": [],
            "first": [],
            "staged": [],
            "limit": [],
            "work": [],
            "gloo": [],
            "flat": [],
            "cross": [],
            "flat_cross": [],
        }
        for _ in range(args.rounds):  # interleaved: a slow moment hits every column alike
            times["ours"].append(_time_ours(nd, args, x, iters))
            if shared is not None:  # (host shm above 64 KiB: private arrays have twins)
                times["shared"].append(_time_ours(nd, args, shared, iters))
                times["first"].append(_time_first(nd, args, x, iters))
                times["staged"].append(_time_staged(nd, args, x, iters))
            if limit:
                times["limit"].append(_time_limit(nd, args, x, iters))
                if shared is not None:
                    times["work"].append(_time_work(nd, args, x, iters))
            if flat is not None:
                for key, g in (("", nd.get_world_group()), ("flat_", flat)):
                    tf, mib = _time_on(nd, args, x, iters, g)
                    times[key + "cross"].append(mib)
                    if key:
                        times["flat"].append(tf)
            if gloo is not None:
                tg = _time_gloo(nd, gloo, args, x, iters)
                if tg is not None:
                    times["gloo"].append(tg)
        del shared
        med = {k: float(np.median(v)) for k, v in times.items() if v}
        t = med["ours"]
        algbw = size / t / 1e9

        def busbw(sec: float, size: int = size) -> float:
            return size / sec / 1e9 * 2 * (n - 1) / n

        row = dict(
            size=size,
            size_h=_human(size),
            count=count,
            dtype=dtype.name,
            ranks=n,
            backend=nd.get_world_group().backend,
            iters=iters,
            rounds=args.rounds,
            time_us=t * 1e6,
            algbw_GBps=algbw,
            busbw_GBps=algbw * 2 * (n - 1) / n,
        )
        if "shared" in med:
            row.update(shared_time_us=med["shared"] * 1e6, shared_busbw_GBps=busbw(med["shared"]))
            row.update(reused_vs_shared=med["shared"] / t, first_busbw_GBps=busbw(med["first"]))
            row.update(first_time_us=med["first"] * 1e6, staged_busbw_GBps=busbw(med["staged"]))
        if "limit" in med:
            tl = med["limit"]
            row.update(limit_time_us=tl * 1e6, limit_busbw_GBps=busbw(tl), vs_limit=tl / t)
            if "shared" in med:
                row.update(shared_vs_limit=tl / med["shared"])
        if "work" in med and "shared" in med:
            tw = med["work"]
            row.update(work_busbw_GBps=busbw(tw), shared_vs_work=tw / med["shared"])
        if "flat" in med:
            row.update(flat_busbw_GBps=busbw(med["flat"]), vs_flat=med["flat"] / t)
            row.update(cross_MiB=med["cross"], flat_cross_MiB=med["flat_cross"])
        if "gloo" in med:
            tg = med["gloo"]
            row.update(gloo_time_us=tg * 1e6, gloo_busbw_GBps=busbw(tg), vs_gloo=tg / t)
        rows.append(row)
        if prog:
            prog.step(_human(size))
    if prog:
        prog.close()
    if gloo is not None:
        gloo[1].destroy_process_group()
    if rank == 0:
        _report(args, rows, n)
    nd.destroy_process_group()
    return rows


def _report(args, rows: list, n: int) -> None:
    shown = [dict(r, size=r["size_h"]) for r in rows]
    print(
        f"# all_reduce ({args.op}), {n} ranks, backend {rows[0]['backend'] if rows else '?'}; "
        f"busbw = algbw * 2(n-1)/n; vs_gloo = gloo time / our time; "
        f"vs_limit = copy+add limit time / our time (same run); shared_*: ours on buffers in "
        f"the group's shared memory (DDP's buckets on shm), read and written in place; work = "
        f"that op's own memory work on local arrays (shared_vs_work = work time / shared time); "
        f"ours = a private array reused (reused_vs_shared = shared time / ours), first = a new "
        f"private array each call, staged = private without twins"
    )
    print(format_table(shown, [c for c in COLUMNS if any(c in r for r in rows)], FORMATS))
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        write_csv(rows, args.csv)
        print(f"# wrote {args.csv}")
    if args.png and rows:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        ours = f"nccl_ddp {rows[0]['backend']}"
        points = [dict(size=r["size"], busbw=r["busbw_GBps"], series=ours) for r in rows]
        points += [
            dict(size=r["size"], busbw=r["shared_busbw_GBps"], series=f"{ours}, shared buffers")
            for r in rows
            if "shared_busbw_GBps" in r
        ]
        points += [
            dict(size=r["size"], busbw=r["gloo_busbw_GBps"], series="torch gloo")
            for r in rows
            if "gloo_busbw_GBps" in r
        ]
        if plot_series(
            points,
            "size",
            "busbw",
            "series",
            args.png,
            title=f"all_reduce {rows[0]['dtype']}, {n} ranks",
            xlabel="message size (bytes)",
            ylabel="busbw (GB/s)",
        ):
            print(f"# wrote {args.png}")


def _spawned(rank: int, n: int, env: dict, args) -> None:
    per_node = n // args.nodes
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank % per_node), GROUP_RANK=str(rank // per_node))
    worker(args)


def spawn(args) -> int:
    """Start `args.nranks` ranks on this host and wait for them (bounded by --timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "WORLD_SIZE": str(args.nranks),
        "LOCAL_WORLD_SIZE": str(args.nranks // args.nodes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NCCL_DDP_SECRET": secrets.token_hex(16),
    }
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, args.nranks, env, args)) for r in range(args.nranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        print(f"bench_allreduce: ranks exited with {codes}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under nccl-ddp-run / torchrun
        worker(args)
        return 0
    return spawn(args)


if __name__ == "__main__":
    sys.exit(main())
