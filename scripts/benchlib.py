"""Shared by the benchmark scripts: their common options, a progress line, CSV output and PNG
plots, and the DDP benchmarks' comm hooks and torch.distributed group.

Benchmarks keep their results as a list of dicts (one per measurement); these helpers turn that
into a table on stdout, a CSV file and a picture. matplotlib is optional (the `plot` extra).
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np


def bench_parser(
    doc: str, csv_name: Optional[str], steps: int = 20, warmup: int = 3
) -> argparse.ArgumentParser:
    """The options of the timing scripts: --nranks, --steps (timed steps per round), --rounds,
    --warmup, --csv (out/CSV_NAME.csv; none when csv_name is None) and --timeout; a script
    adds its own and parses."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--nranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=warmup)
    if csv_name is not None:
        p.add_argument("--csv", default=f"out/{csv_name}.csv", help="CSV path ('' for none)")
    p.add_argument("--timeout", type=float, default=1800)
    return p


def array_module(nd: Any) -> Any:
    """numpy, or cupy when the world group is NCCL's: NCCL reduces GPU memory only, and the
    nccl backend refuses NumPy arrays."""
    if nd.get_world_group().backend == "nccl":
        import cupy

        return cupy
    return np


def run_ranks(
    script: str, nranks: int, argv: Sequence[str], timeout: float, env: Optional[dict] = None
) -> int:
    """Run `script argv` on `nranks` ranks through nccl-ddp-run (this Python), one BLAS thread
    per rank unless set: the ranks share the cores. Returns the launcher's exit status."""
    cmd = [
        sys.executable,
        "-m",
        "nccl_ddp.launch",
        "--nproc-per-node",
        str(nranks),
        os.path.abspath(script),
        *argv,
    ]
    env = dict(os.environ if env is None else env)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return subprocess.run(cmd, timeout=timeout, env=env).returncode


def synchronize(xp: Any) -> None:
    """Wait for the device work queued so far (NCCL calls return before the GPU ran them)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def slowest(nd: Any, value: float) -> float:
    """The largest `value` over the ranks (one max all-reduce, on the backend's array type)."""
    t = array_module(nd).asarray(np.array([value], np.float64))
    nd.all_reduce(t, op="max")
    return float(t[0])


def timed_steps(
    nd: Any, step: Callable[[], None], warmup: int, steps: int, sync: Callable[[], None]
) -> float:
    """Mean seconds per `step()` on the slowest rank, device work included (`sync` waits for it)."""
    for _ in range(warmup):
        step()
    sync()
    nd.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return slowest(nd, (time.perf_counter() - t0) / steps)


class Progress:
    """`done/total label` on one rewritten line; silent when stderr is not a terminal."""

    def __init__(self, total: int, label: str = "", stream=None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() and os.environ.get("NCCL_DDP_NO_PROGRESS") != "1"

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.enabled:
            self.stream.write(f"\r\x1b[K{self.label} {self.done}/{self.total} {what}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _cell(row: dict, column: str, formats: dict, empty: str) -> str:
    v = row.get(column, "")
    if v is None or v == "":
        return empty
    return format(v, formats[column]) if column in formats and isinstance(v, (int, float)) else str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str], formats: Optional[dict] = None) -> str:
    """Right-aligned text table of `columns` from `rows`; `formats` maps column -> format spec.
    A markdown table instead when NCCL_DDP_BENCH_MARKDOWN=1 (scripts/bench_all.sh sets it)."""
    formats = formats or {}
    if os.environ.get("NCCL_DDP_BENCH_MARKDOWN") == "1":
        return markdown_table(rows, columns, formats)
    cells = [[_cell(r, c, formats, "-") for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict], columns: Sequence[str], formats: Optional[dict] = None) -> str:
    """`rows` as a markdown table ready to paste into docs/benchmarks.md (numbers right-aligned)."""
    formats = formats or {}
    numeric = [any(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_cell(r, c, formats, "") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: str) -> None:
    """All keys that appear in any row become columns, in first-seen order (the folder is made
    when missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    columns: list = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _draw(
    ax,
    rows: Sequence[dict],
    x: str,
    y: str,
    series: str,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = True,
    logy: bool = False,
    hlines: Iterable = (),
) -> None:
    for name in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[series] == name and r.get(y) not in (None, ""))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=str(name))
    for value, label in hlines:
        ax.axhline(value, ls="--", lw=1, color="gray")
        ax.annotate(
            label, (0.01, value), xycoords=("axes fraction", "data"), fontsize=8, va="bottom", color="gray"
        )
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def plot_panels(panels: Sequence[dict], path: str) -> bool:
    """Side-by-side plots; each panel is the keyword arguments of `plot_series` (without path).
    Returns False (and says why) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        print(
            f"matplotlib is not installed: no plot written to {path} (pip install 'nccl_ddp[plot]')",
            file=sys.stderr,
        )
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw(ax, **panel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_series(rows: Sequence[dict], x: str, y: str, series: str, path: str, **kw) -> bool:
    """One line per distinct value of `series` (title, xlabel, ylabel, logx, logy, hlines)."""
    return plot_panels([dict(rows=rows, x=x, y=y, series=series, **kw)], path)


def launch_or_work(
    script: str,
    args: Any,
    argv: Optional[Sequence[str]],
    worker: Callable[[Any], None],
    env: Optional[dict] = None,
) -> int:
    """A benchmark's main: under a launcher (RANK set) run `worker(args)`, else start
    `args.nranks` ranks of `script` through nccl-ddp-run with the same arguments."""
    if "RANK" not in os.environ:
        return run_ranks(script, args.nranks, sys.argv[1:] if argv is None else list(argv), args.timeout, env)
    worker(args)
    return 0


# ---------------------------------------------------------------------------------------------
# the DDP benchmarks (bench_ddp.py and its torch / many-params modes)

POWERSGD_RANK = 4


def our_hook(nd, ddp, hook: str):
    """Register our built-in `hook` on `ddp`; returns the PowerSGD state (else None)."""
    from nccl_ddp import hooks

    if hook == "allreduce":
        return None
    if hook == "powersgd":
        state = hooks.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, hooks.powersgd)
        return state
    ddp.register_comm_hook(None, getattr(hooks, f"{hook}_compress"))
    return None


def sent_mib(buckets, hook: str, state, before: int, steps: int) -> float:
    """MiB each rank hands to all-reduces per step: the buckets (float32 ones in half precision
    with fp16/bf16), or PowerSGD's factors and uncompressed grads (its element count)."""
    if hook == "powersgd":
        return (state.total_numel_after_compression - before) * 4 / max(1, steps) / 2**20
    half = hook in ("bf16", "fp16")
    return sum(b.nbytes // (2 if half and np.dtype(b.dtype) == np.float32 else 1) for b in buckets) / 2**20


_TORCH_PG: dict = {}


def init_torch_pg(nd, torch, backend: str) -> str:
    """One torch.distributed group per process (all caps share it); returns its backend."""
    if _TORCH_PG:
        return _TORCH_PG["backend"]
    import torch.distributed as dist

    port = array_module(nd).zeros(1, dtype=np.int64)  # cupy on the nccl backend
    if nd.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    nd.broadcast(port, 0)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{int(port[0])}",
        rank=nd.get_rank(),
        world_size=nd.get_world_size(),
    )
    _TORCH_PG["backend"] = backend
    return backend
