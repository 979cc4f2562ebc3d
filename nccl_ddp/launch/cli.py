"""The `nccl-ddp-run` command line: our flags and every torchrun flag.

Every flag is accepted with dashes and with underscores (`--nproc-per-node`, `--nproc_per_node`)
and falls back to the environment variable shown in its help, then to torchrun's `PET_<FLAG>`.
`--rdzv-endpoint host:port` sets the master address and port. torchrun flags that have no meaning
here (`--logs-specs`, `--numa-binding`, `--event-log-handler`, `--local-addr`) are accepted with a
one-line notice.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from typing import Any, Optional, Sequence

from nccl_ddp.env import LOOPBACK
from nccl_ddp.errors import ConfigError, NcclDdpError
from nccl_ddp.launch.config import LaunchConfig
from nccl_ddp.launch.logs import parse_std
from nccl_ddp.launch.supervisor import DEFAULT_SIGNALS, parse_signals

log = logging.getLogger("nccl_ddp.launch")

RDZV_BACKENDS = ("c10d", "static")
TORCHRUN_RDZV_PORT = 29400  # torchrun's port when --rdzv-endpoint names a host only
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


def _endpoint(value: str) -> tuple:
    host, sep, port = value.rpartition(":")
    if not sep or not host:  # a host name alone
        return value, TORCHRUN_RDZV_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint={value!r}: use host:port (e.g. 10.0.0.1:29500)") from None


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


def _parser() -> argparse.ArgumentParser:
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


def _rdzv_conf(value: str) -> dict:
    conf = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise ConfigError(f"--rdzv-conf={value!r}: use key=value,key=value (e.g. join_timeout=900)")
        conf[key.strip()] = val.strip()
    ignored = sorted(k for k in conf if k not in ("join_timeout", "is_host"))
    if ignored:
        log.warning("--rdzv-conf: %s ignored (only join_timeout and is_host apply here)", ", ".join(ignored))
    return conf


def _conf_bool(conf: dict, key: str) -> Optional[bool]:
    """An `--rdzv-conf` flag as torchrun's `RendezvousParameters.get_as_bool` reads it: 1, true,
    t, yes, y or 0, false, f, no, n (any case); anything else is an error, never a silent False."""
    value = conf.get(key)
    if value is None:
        return None
    if value.lower() in ("1", "true", "t", "yes", "y"):
        return True
    if value.lower() in ("0", "false", "f", "no", "n"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={value!r} is not a boolean; use {key}=1 or {key}=0 (true/false)")


def _notices(a: argparse.Namespace) -> None:
    """One line per accepted torchrun flag that changes nothing here."""
    if a.logs_specs:
        log.warning("--logs-specs=%s ignored: the log layout is torchrun's default one", a.logs_specs)
    if a.numa_binding:
        log.warning(
            "--numa-binding=%s ignored: workers are not pinned (wrap the script in numactl to pin them)",
            a.numa_binding,
        )
    if a.event_log_handler not in (None, "null"):
        log.warning("--event-log-handler=%s ignored: no torchelastic events are emitted", a.event_log_handler)
    if a.local_addr:
        log.warning("--local-addr=%s ignored: nodes reach node 0 at --master-addr", a.local_addr)
    if a.start_method != "spawn" and a.run_path:
        log.warning("--start-method=%s: each worker is a fresh interpreter (spawn) here", a.start_method)


def parse_args(argv: Optional[Sequence[str]] = None) -> LaunchConfig:
    a = _parser().parse_args(argv)
    if a.rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(
            f"--rdzv-backend={a.rdzv_backend!r}: use one of {RDZV_BACKENDS} "
            f"(node 0's launcher hosts the store either way)"
        )
    _notices(a)
    conf = _rdzv_conf(a.rdzv_conf)
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        addr, port = _endpoint(a.rdzv_endpoint)
    store_port = a.store_port
    if a.standalone:
        addr, port, store_port = LOOPBACK, 0, 0
    node_rank = a.node_rank
    if node_rank is None and not (a.rdzv_backend == "c10d" and a.nnodes > 1):
        node_rank = 0
    auto = a.standalone or (
        a.rdzv_backend == "static" and not a.rdzv_endpoint and not port and a.nnodes == 1
    )  # torchrun's own rule for a random run id
    run_id = a.rdzv_id or (str(uuid.uuid4()) if auto else "none")
    redirects = parse_std(a.redirects, "--redirects")
    tee = parse_std(a.tee, "--tee") if a.tee is not None else (3 if a.log_dir and not redirects else 0)
    try:
        ranks = frozenset(int(r) for r in a.local_ranks_filter.split(",")) if a.local_ranks_filter else None
        if ranks is not None and min(ranks) < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter={a.local_ranks_filter!r}: use comma-separated local ranks (0 or "
            "more), e.g. 0 or 0,1"
        ) from None
    try:
        join_timeout = float(conf.get("join_timeout", 600))
    except ValueError:
        raise ConfigError(
            f"--rdzv-conf join_timeout={conf['join_timeout']!r}: use seconds, e.g. join_timeout=900"
        ) from None
    is_host = _conf_bool(conf, "is_host")
    return LaunchConfig(
        entrypoint=a.entrypoint,
        args=tuple(a.args),
        module=a.module,
        nproc_per_node=a.nproc_per_node,
        nnodes=a.nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        store_port=store_port,
        standalone=a.standalone,
        log_dir=a.log_dir,
        max_restarts=a.max_restarts,
        run_id=run_id,
        grace_period=a.shutdown_timeout if a.shutdown_timeout is not None else a.grace_period,
        secret=os.environ.get("NCCL_DDP_SECRET") or None,
        rdzv_backend=a.rdzv_backend,
        join_timeout=join_timeout,
        is_host=is_host,
        role=a.role,
        monitor_interval=a.monitor_interval,
        no_python=a.no_python,
        run_path=a.run_path,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks,
        signals=parse_signals(a.signals_to_handle),
        virtual_local_rank=a.virtual_local_rank,
        duplicate_filters=(a.duplicate_stdout_filters, a.duplicate_stderr_filters),
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    from nccl_ddp.launch.launcher import launch

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("nccl-ddp-run: %(message)s"))
    logging.getLogger("nccl_ddp").addHandler(handler)
    logging.getLogger("nccl_ddp").setLevel(logging.INFO)
    try:
        code = launch(parse_args(argv))
    except NcclDdpError as e:
        log.error("%s", e)
        code = 2
    sys.exit(code)
