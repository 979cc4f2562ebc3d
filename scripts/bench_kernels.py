#!/usr/bin/env python3
"""Bandwidth of the bucket kernels (pack / unpack) and the fused optimizer steps (sgd / adamw on
one flat shard) against a plain device-to-device copy of the same bytes and a naive per-tensor
CuPy loop (bucket kernels), on one GPU.

GB/s counts bytes read + bytes written. "kernel" times back-to-back launches of the prepared
kernel between CUDA events (cached table, no Python validation); "call" is the host time of one
`nccl_ddp.kernels.pack/unpack` call with a warm cache (what the reducer pays on the CPU). Buffers
rotate among several sets so that repeated runs do not measure the L2 cache. For sgd (momentum)
and adamw, MiB is the float32 master shard's size and the pair names the grad/parameter dtype
(f32: float32 grads and parameters; f32-bf16: bfloat16 grads and parameters, float32 master);
they run once per size (the tensor count and chunk settings do not apply).

    python scripts/bench_kernels.py --csv out/bench_kernels.csv
    python scripts/bench_kernels.py --sizes 25 --counts 1,10000 --chunk-bytes 4096,8192,16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import format_table, plot_series, write_csv  # noqa: E402

MIB = 1 << 20
PAIRS = {"f32": ("float32", "float32"), "f32-bf16": ("float32", "bfloat16")}
OPTIM_DTYPES = {"f32": ("float32", "float32"), "f32-bf16": ("bfloat16", "bfloat16")}  # grad, param
OPTIM_OPS = ("sgd", "adamw")
COLUMNS = [
    "op",
    "pair",
    "MiB",
    "tensors",
    "fixed_B",
    "chunk",
    "kernel_us",
    "kernel_GBps",
    "copy_GBps",
    "ratio",
    "naive_GBps",
    "call_us",
]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,25,100", help="bucket sizes in MiB of the tensors (1,4,25,100)")
    p.add_argument("--counts", default="1,100,10000", help="tensors per bucket (1,100,10000)")
    p.add_argument("--pairs", default="f32,f32-bf16", help=f"of {sorted(PAIRS)}")
    p.add_argument("--ops", default="pack,unpack,sgd,adamw")
    p.add_argument(
        "--chunk-bytes",
        default="",
        help="sweep fixed chunk sizes in bytes, 0 = adaptive (comma-separated; default: adaptive only)",
    )
    p.add_argument("--reps", type=int, default=30, help="timed batches per measurement (30)")
    p.add_argument("--batch", type=int, default=10, help="launches per timed batch (10)")
    p.add_argument("--naive-reps", type=int, default=3, help="timed naive loops (3)")
    p.add_argument("--scale", type=float, default=0.5, help="fused scale (0.5 = 1/world of 2)")
    p.add_argument(
        "--rotate-mib", type=int, default=256, help="footprint of the rotating buffer sets, 2 to 8 sets (256)"
    )
    p.add_argument("--csv", default="out/bench_kernels.csv", help="CSV path ('' for none)")
    p.add_argument(
        "--png",
        default="out/bench_kernels.png",
        help="kernel GB/s against bucket size beside the copy ceiling ('' for none)",
    )
    return p.parse_args(argv)


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


class Bench:
    def __init__(self, cp, args):
        import ml_dtypes

        from nccl_ddp import kernels as K
        from nccl_ddp.kernels import cuda as ck

        self.cp, self.args, self.ck, self.K = cp, args, ck, K
        self.kb = ck.backend()
        self.dt = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
        self.stream = cp.cuda.Stream(non_blocking=True)

    def time_batches(self, launch, nsets, reps, batch):
        """Median seconds per launch over `reps` batches of `batch` back-to-back launches."""
        cp = self.cp
        for i in range(min(3, nsets) + 1):  # warm-up (compiles, uploads tables)
            launch(i % nsets)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times, k = [], 0
        for _ in range(reps):
            start.record(self.stream)
            for _ in range(batch):
                launch(k % nsets)
                k += 1
            end.record(self.stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / batch)
        return statistics.median(times)

    def make_sets(self, nbytes_src, count, pair):
        cp, rng = self.cp, np.random.default_rng(count)
        src_dt, bkt_dt = self.dt[pair[0]], self.dt[pair[1]]
        total = nbytes_src // src_dt.itemsize
        w = rng.uniform(0.5, 1.5, count)
        sizes = np.floor(w / w.sum() * total).astype(np.int64)
        sizes[-1] += total - sizes.sum()
        align = 16 // bkt_dt.itemsize
        padded = -(-sizes // align) * align
        offs = np.concatenate([[0], np.cumsum(padded)[:-1]]).tolist()
        bucket_n = int(padded.sum())
        per_set = nbytes_src + bucket_n * bkt_dt.itemsize
        nsets = int(max(2, min(8, -(-self.args.rotate_mib * MIB // per_set))))
        sets = []
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for _ in range(nsets):  # random data, never zeros; the bucket filled by one pack
            flat = cp.random.standard_normal(total, dtype=cp.float32).astype(src_dt)
            tensors = [flat[bounds[i] : bounds[i + 1]] for i in range(count)]
            bucket = cp.empty(bucket_n, dtype=bkt_dt)
            self.K.pack(tensors, bucket, offs)
            sets.append((flat, tensors, bucket))
        cp.cuda.Device().synchronize()
        return sets, offs, total

    def kernel_launcher(self, op, sets, offs, pair):
        """Launch the prepared kernel directly (what one pack/unpack call launches)."""
        ck, kb, dev = self.ck, self.kb, self.cp.cuda.Device().id
        prepared = []
        with self.stream:
            for _, tensors, bucket in sets:
                sizes = np.array([t.size for t in tensors], np.int64)
                kpair = pair if op == "pack" else (pair[1], pair[0])  # (source, destination)
                tab, chunk = kb.table(op, kpair, tensors, bucket, sizes, np.array(offs, np.int64))
                name = ck.kernel_name(op, kpair, False, tab.small is not None)
                args = kb.launch_args(tab, bucket, chunk, self.args.scale) + (None,)  # no flag
                prepared.append((kb.function(dev, name), tab.grid, args, chunk))
        self.last_chunk = prepared[0][3]

        def launch(i):
            fn, grid, args, _ = prepared[i]
            fn((grid,), (ck.THREADS,), args, stream=self.stream)

        return launch

    def measure(self, op, pair_key, mib, count):
        cp, args = self.cp, self.args
        pair = PAIRS[pair_key]
        sets, offs, total = self.make_sets(mib * MIB, count, pair)
        src_b = total * self.dt[pair[0]].itemsize
        bkt_b = total * self.dt[pair[1]].itemsize
        moved = src_b + bkt_b
        t_kernel = self.time_batches(
            self.kernel_launcher(op, sets, offs, pair), len(sets), args.reps, args.batch
        )
        copies = [(cp.empty(total, self.dt[pair[0]]), s[0]) for s in sets]

        def copy(i):
            dst, src = copies[i]
            dst.data.copy_from_device_async(src.data, src_b, self.stream)

        t_copy = self.time_batches(copy, len(sets), args.reps, args.batch)
        naive = self.naive(op, sets, offs, pair)
        t_call = self.call_time(op, sets, offs)
        return {
            "op": op,
            "pair": pair_key,
            "MiB": mib,
            "tensors": count,
            "fixed_B": self.ck.CHUNK_BYTES or "auto",
            "chunk": self.last_chunk,
            "kernel_us": t_kernel * 1e6,
            "kernel_GBps": moved / t_kernel / 1e9,
            "copy_GBps": 2 * src_b / t_copy / 1e9,
            "ratio": (moved / t_kernel) / (2 * src_b / t_copy),
            "naive_GBps": moved / naive / 1e9 if naive else None,
            "call_us": t_call * 1e6,
        }

    def measure_optim(self, op, pair_key, mib):
        """One fused optimizer step over a `mib` MiB float32 shard, launched directly."""
        from nccl_ddp.kernels import cuda_optim
        from nccl_ddp.kernels import optim_spec as S

        cp, args, dev = self.cp, self.args, self.cp.cuda.Device().id
        gdt, pdt = (self.dt[t] for t in OPTIM_DTYPES[pair_key])
        n = mib * MIB // 4
        nstate = 2 if op == "adamw" else 1
        moved = n * (4 * 2 * (1 + nstate) + gdt.itemsize + pdt.itemsize)
        nsets = int(max(2, min(8, -(-args.rotate_mib * MIB // moved))))
        if op == "adamw":
            sc = S.adamw_scalars(
                step=10,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=1e-2,
                amsgrad=False,
                grad_scale=args.scale,
            )
            scalars = cuda_optim.adamw_args(sc)
        else:
            sc = S.sgd_scalars(
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                weight_decay=1e-4,
                nesterov=False,
                fresh_buffer=False,
                grad_scale=args.scale,
            )
            scalars = cuda_optim.sgd_args(sc)
        sets, prepared = [], []
        for _ in range(nsets):  # random data, never zeros
            rnd = [cp.random.standard_normal(n, dtype=cp.float32) for _ in range(2 + nstate)]
            master, grad, states = rnd[0], rnd[1].astype(gdt), rnd[2:]
            if op == "adamw":
                states[1] = cp.abs(states[1])
                states.append(None)
            out = cp.empty(n, dtype=pdt)
            sets.append((master, grad, states, out))
            name, grid, kargs = cuda_optim.prepare(op, master, grad, states, out, scalars)
            prepared.append((self.kb.function(dev, name), grid, kargs))
        cp.cuda.Device().synchronize()

        def launch(i):
            fn, grid, kargs = prepared[i]
            fn((grid,), (self.ck.THREADS,), kargs, stream=self.stream)

        t_kernel = self.time_batches(launch, nsets, args.reps, args.batch)
        half = moved // 2
        copies = [(cp.empty(half, cp.uint8), cp.empty(half, cp.uint8)) for _ in range(nsets)]

        def copy(i):
            dst, src = copies[i]
            dst.data.copy_from_device_async(src.data, half, self.stream)

        t_copy = self.time_batches(copy, nsets, args.reps, args.batch)
        step = self.K.adamw_step if op == "adamw" else self.K.sgd_step
        kw = dict(step=10, lr=1e-3) if op == "adamw" else dict(lr=0.1, momentum=0.9)
        with self.stream:
            master, grad, states, out = sets[0]
            step(master, grad, *states, out, **kw)
            self.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(8):
                step(master, grad, *states, out, **kw)
            t_call = (time.perf_counter() - t0) / 8
            self.stream.synchronize()
        return {
            "op": op,
            "pair": pair_key,
            "MiB": mib,
            "tensors": 1,
            "fixed_B": "n/a",
            "chunk": None,
            "kernel_us": t_kernel * 1e6,
            "kernel_GBps": moved / t_kernel / 1e9,
            "copy_GBps": 2 * half / t_copy / 1e9,
            "ratio": (moved / t_kernel) / (2 * half / t_copy),
            "naive_GBps": None,
            "call_us": t_call * 1e6,
        }

    def naive(self, op, sets, offs, pair):
        """One CuPy op per tensor (scale fused into a multiply with out=, or astype + assign)."""
        cp, scale = self.cp, self.args.scale
        same = pair[0] == pair[1]

        def run(i):
            _, tensors, bucket = sets[i]
            for t, o in zip(tensors, offs):
                view = bucket[o : o + t.size]
                if op == "pack":
                    if same:
                        cp.multiply(t, scale, out=view)
                    else:
                        view[...] = (t * scale).astype(bucket.dtype)
                elif same:
                    cp.multiply(view, scale, out=t)
                else:
                    t[...] = view.astype(t.dtype) * scale

        try:
            with self.stream:
                return self.time_batches(run, len(sets), self.args.naive_reps, 1)
        except Exception as e:  # e.g. no bfloat16 arithmetic in this CuPy
            print(f"  naive {op} {pair}: n/a ({type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
            return None

    def call_time(self, op, sets, offs):
        """Host seconds per public call with a warm table cache (the GPU work stays async)."""
        K, scale = self.K, self.args.scale
        fn = K.pack if op == "pack" else K.unpack
        with self.stream:
            for s in sets:
                fn(s[1], s[2], offs, scale=scale)
            self.stream.synchronize()
            n = max(4, len(sets))
            t0 = time.perf_counter()
            for i in range(n):
                _, tensors, bucket = sets[i % len(sets)]
                fn(tensors, bucket, offs, scale=scale)
            t = (time.perf_counter() - t0) / n
            self.stream.synchronize()
        return t


def sweep(bench, args, cp, ck):
    """Every (chunk, op, pair, size, count) measurement; one that fails is reported and skipped."""
    rows, failures = [], 0
    ops = args.ops.split(",")
    configs = [
        (op, pair, mib, count)
        for op in ops
        if op not in OPTIM_OPS
        for pair in args.pairs.split(",")
        for mib in ints(args.sizes)
        for count in ints(args.counts)
    ]
    optim = [
        (op, pair, mib, 1)
        for op in ops
        if op in OPTIM_OPS
        for pair in args.pairs.split(",")
        for mib in ints(args.sizes)
    ]
    default_chunk = ck.CHUNK_BYTES
    try:
        for k, chunk in enumerate([c or None for c in ints(args.chunk_bytes)] or [ck.CHUNK_BYTES]):
            ck.CHUNK_BYTES = chunk
            bench.kb.clear_cache()
            for op, pair_key, mib, count in configs + (optim if k == 0 else []):
                what = f"{op} {pair_key} {mib} MiB x{count}"
                try:
                    row = (
                        bench.measure_optim(op, pair_key, mib)
                        if op in OPTIM_OPS
                        else bench.measure(op, pair_key, mib, count)
                    )
                except Exception as e:  # keep the other measurements
                    failures += 1
                    print(f"  {what}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    continue
                finally:
                    cp.get_default_memory_pool().free_all_blocks()
                rows.append(row)
                print(
                    f"  {what} chunk {row['chunk']}: {row['kernel_GBps']:.0f} GB/s "
                    f"({row['ratio']:.2f} of copy)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        ck.CHUNK_BYTES = default_chunk
    return rows, failures


def plot(rows, path, gpu_name) -> bool:
    """GB/s against bucket size: one line per (op, dtype pair, tensor count) at the first chunk
    setting measured, and the device-to-device copy of the same bytes (the ceiling)."""
    first = rows[0]["fixed_B"]
    shown = [r for r in rows if r["fixed_B"] in (first, "n/a")]
    points = [
        dict(MiB=r["MiB"], GBps=r["kernel_GBps"], series=f"{r['op']} {r['pair']} x{r['tensors']}")
        for r in shown
    ]
    copy = {}
    for r in shown:
        copy.setdefault(r["MiB"], []).append(r["copy_GBps"])
    points += [dict(MiB=m, GBps=float(np.median(v)), series="D2D copy (ceiling)") for m, v in copy.items()]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return plot_series(
        points,
        "MiB",
        "GBps",
        "series",
        path,
        title=f"kernel bandwidth, {gpu_name}",
        xlabel="bucket (pack/unpack) or shard (sgd/adamw) size (MiB)",
        ylabel="GB/s (bytes read + written)",
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from nccl_ddp.device import cuda_available

    if not cuda_available():
        print(
            "bench_kernels: no CUDA GPU visible to CuPy (or CuPy is not installed); nothing "
            "to measure. Run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    import cupy as cp

    from nccl_ddp.kernels import cuda as ck

    bench = Bench(cp, args)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(
        f"bench_kernels on {name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}"
    )
    rows, failures = sweep(bench, args, cp, ck)
    fmt = {
        "kernel_us": ".1f",
        "kernel_GBps": ".0f",
        "copy_GBps": ".0f",
        "ratio": ".2f",
        "naive_GBps": ".1f",
        "call_us": ".0f",
    }
    print(format_table(rows, COLUMNS, fmt))
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png and rows and plot(rows, args.png, name):
        print(f"wrote {args.png}")
    if failures:
        print(f"bench_kernels: {failures} measurement(s) failed (see above)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
