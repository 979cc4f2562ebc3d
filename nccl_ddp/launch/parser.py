"""The `nccl-ddp-run` parser: our flags and every torchrun flag, each with its environment fallback.

Every flag is accepted with dashes and with underscores (`--nproc-per-node`, `--nproc_per_node`)
and falls back to the environment variable shown in its help, then to torchrun's `PET_<FLAG>`.
torchrun flags that have no meaning here (`--logs-specs`, `--numa-binding`, `--event-log-handler`,
`--local-addr`) are accepted; `cli.parse_args` gives each a one-line notice.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

from nccl_ddp.launch.supervisor import DEFAULT_SIGNALS

RDZV_BACKENDS = ("c10d", "static")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def _nproc(value: str) -> int | str:
    if value in ("auto", "gpu"):
        return "auto"
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an integer nor 'auto' (or torchrun's 'gpu'/'cpu')"
        ) from None


def _nnodes(value: str) -> int:
    """N, or torchrun's MIN:MAX when both are equal (elastic ranges are not supported)."""
    low, _, high = str(value).partition(":")
    try:
        n, m = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a node count (N or N:N)") from None
    if n != m:
        raise argparse.ArgumentTypeError(
            f"{value!r}: elastic node ranges are not supported; pass a fixed count, e.g. --nnodes {m}"
        )
    return n


def _filters(value: str) -> tuple:
    """torchrun's comma-separated list, ',,' standing for a comma."""
    return tuple(item.replace("\0", ",") for item in value.replace(",,", "\0").split(",") if item)


def _env(*names: str, default: Optional[str] = None) -> Optional[str]:
    """The first of `names` set in the environment, else `default`."""
    return next((os.environ[n] for n in names if os.environ.get(n)), default)


def _flag(p: argparse.ArgumentParser, name: str, *short: str, env: Sequence[str] = (), **kw: Any) -> None:
    """Add `--a-b` with its underscore twin `--a_b` (torchrun accepts both); the default comes
    from `env`, then torchrun's PET_A_B, then `default`."""
    dest = name.replace("-", "_")
    names = list(short) + [f"--{name}"] + ([f"--{dest}"] if "-" in name else [])
    pet = f"PET_{dest.upper()}"
    if kw.get("action") == "store_true":
        kw["default"] = _env(*env, pet, default="0") not in ("0", "", "false", "False")
    else:
        kw["default"] = _env(*env, pet, default=kw.get("default"))
    p.add_argument(*names, dest=dest, **kw)


def _node_flags(p: argparse.ArgumentParser) -> None:
    """How many workers and nodes, and where node 0 is."""
    _flag(
        p,
        "nproc-per-node",
        type=_nproc,
        env=["NCCL_DDP_NPROC_PER_NODE"],
        default="auto",
        help="workers on this node: an integer or 'auto' (one per GPU, 2 without a GPU) "
        "[NCCL_DDP_NPROC_PER_NODE]",
    )
    _flag(
        p,
        "nnodes",
        type=_nnodes,
        env=["NCCL_DDP_NNODES"],
        default="1",
        help="number of nodes (N, or torchrun's N:N) [NCCL_DDP_NNODES]",
    )
    _flag(
        p,
        "node-rank",
        type=int,
        env=["NCCL_DDP_NODE_RANK", "GROUP_RANK", "SLURM_NODEID"],
        help="this node's index, 0..nnodes-1; unset with --rdzv-backend c10d: assigned at the "
        "rendezvous, node 0 on the endpoint's host [NCCL_DDP_NODE_RANK, GROUP_RANK, "
        "SLURM_NODEID]",
    )
    _flag(
        p,
        "master-addr",
        env=["MASTER_ADDR"],
        default="",
        help="address of node 0, where the store runs (127.0.0.1 on one node) [MASTER_ADDR]",
    )
    _flag(
        p,
        "master-port",
        type=int,
        env=["MASTER_PORT"],
        default=0,
        help="MASTER_PORT given to the workers (free for the script's own use, e.g. "
        "torch.distributed); 0 picks a free one (single node) [MASTER_PORT]",
    )


def _rendezvous_flags(p: argparse.ArgumentParser) -> None:
    """How the nodes meet: torchrun's rendezvous flags and our store's port."""
    _flag(p, "rdzv-endpoint", help="torchrun's host[:port] of node 0: sets --master-addr and --master-port")
    _flag(
        p,
        "rdzv-backend",
        default="static",
        help=f"one of {RDZV_BACKENDS}: node 0's launcher hosts the store either way; c10d "
        f"without --node-rank assigns node ranks at the rendezvous",
    )
    _flag(
        p,
        "rdzv-id",
        env=["TORCHELASTIC_RUN_ID"],
        help="the job's name: TORCHELASTIC_RUN_ID, and the log directory's prefix",
    )
    _flag(
        p,
        "rdzv-conf",
        default="",
        help="key=value,...: join_timeout (seconds the nodes wait for each other, 600), "
        "is_host (c10d: host the store on this node)",
    )
    _flag(
        p,
        "store-port",
        type=int,
        env=["NCCL_DDP_STORE_PORT"],
        default=0,
        help="port of our store on node 0; 0: a free one on one node, MASTER_PORT+1 across "
        "nodes [NCCL_DDP_STORE_PORT]",
    )
    _flag(
        p,
        "standalone",
        action="store_true",
        help="single node on loopback with a free port (ignores MASTER_ADDR/PORT)",
    )


def _worker_flags(p: argparse.ArgumentParser) -> None:
    """What each worker runs and how often the launcher restarts and watches it."""
    _flag(
        p,
        "max-restarts",
        type=int,
        env=["NCCL_DDP_MAX_RESTARTS"],
        default=0,
        help="when a worker fails, stop all and start all again, up to N times [NCCL_DDP_MAX_RESTARTS]",
    )
    _flag(p, "monitor-interval", type=float, default=0.1, help="seconds between looks at the workers")
    _flag(
        p,
        "start-method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="torchrun's multiprocessing start method; workers here are always new processes",
    )
    _flag(p, "role", default="default", help="the workers' role: ROLE_NAME")
    _flag(p, "module", "-m", action="store_true", help="run the entrypoint as a module (python -m)")
    _flag(
        p, "no-python", action="store_true", help="run the entrypoint itself (an executable), not with python"
    )
    _flag(
        p,
        "run-path",
        action="store_true",
        help="run the script (absolute path) with runpy.run_path in each worker's interpreter",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """Where the workers' stdout and stderr go: log files, console, or both."""
    _flag(
        p,
        "log-dir",
        env=["NCCL_DDP_LOG_DIR"],
        help="torchrun's log layout: DIR/<rdzv-id>_<random>/attempt_<N>/<local rank>/ holds "
        "stdout.log, stderr.log (with --tee/--redirects; both by default) and error.json "
        "[NCCL_DDP_LOG_DIR]",
    )
    _flag(
        p,
        "redirects",
        "-r",
        default="0",
        help="send streams to the log files only: 1 stdout, 2 stderr, 3 both, or per local "
        "rank, e.g. 0:1,1:2",
    )
    _flag(
        p,
        "tee",
        "-t",
        help="send streams to the log files and the console (as --redirects); "
        "default 3 with --log-dir, else 0",
    )
    _flag(
        p,
        "local-ranks-filter",
        default="",
        help="show only these local ranks' output on the console, e.g. 0 or 0,1 (logs keep all)",
    )


def _stop_flags(p: argparse.ArgumentParser) -> None:
    """How the launcher stops the workers: the signals it forwards and the grace before SIGKILL."""
    _flag(
        p,
        "signals-to-handle",
        default=DEFAULT_SIGNALS,
        help="signals the launcher forwards to the workers before stopping",
    )
    _flag(
        p,
        "grace-period",
        type=float,
        env=["NCCL_DDP_GRACE_PERIOD"],
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping workers [NCCL_DDP_GRACE_PERIOD]",
    )
    _flag(p, "shutdown-timeout", type=float, help="torchrun's name for --grace-period")


def _device_flags(p: argparse.ArgumentParser) -> None:
    """Which GPU each worker sees."""
    _flag(
        p,
        "virtual-local-rank",
        action="store_true",
        help="LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES its own GPU only",
    )


def _filtered_log_flags(p: argparse.ArgumentParser) -> None:
    """Extra log files holding the stdout/stderr lines that match a filter."""
    for stream in ("stdout", "stderr"):
        _flag(
            p,
            f"duplicate-{stream}-filters",
            type=_filters,
            default="",
            help=f"also copy {stream} lines containing any of these (comma-separated, ',,' "
            f"for a comma) to attempt_<N>/filtered_{stream}.log in the log directory",
        )


def _torchrun_only_flags(p: argparse.ArgumentParser) -> None:
    """torchrun flags accepted so its command lines run, with no effect here."""
    for name, kw in (
        ("logs-specs", {}),
        ("numa-binding", {"choices": NUMA_MODES}),
        ("event-log-handler", {"default": "null"}),
        ("local-addr", {}),
    ):
        _flag(p, name, help="accepted for torchrun command lines; has no effect here", **kw)


def build_parser() -> argparse.ArgumentParser:
    """The `nccl-ddp-run` parser: every flag of ours and of torchrun, in `--help` order."""
    p = argparse.ArgumentParser(
        prog="nccl-ddp-run",
        description="Start one nccl_ddp worker per GPU on this node.",
        epilog="Each option falls back to the environment variable shown in its help, then to "
        "torchrun's PET_<OPTION>; torchrun's spellings (underscores) are accepted.",
    )
    _node_flags(p)
    _rendezvous_flags(p)
    _worker_flags(p)
    _output_flags(p)
    _stop_flags(p)
    _device_flags(p)
    _filtered_log_flags(p)
    _torchrun_only_flags(p)
    p.add_argument("entrypoint", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p
