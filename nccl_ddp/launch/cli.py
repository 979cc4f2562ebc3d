"""The `nccl-ddp-run` command line: our flags and torchrun's spellings of the ones we share.

Every flag is accepted with dashes and with underscores (`--nproc-per-node`, `--nproc_per_node`),
`--rdzv-endpoint host:port` sets the master address and port, `--rdzv-backend c10d|static` and
`--rdzv-id` are accepted (the id names the job: TORCHELASTIC_RUN_ID), and each flag falls back to
the environment variable shown in its help.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from nccl_ddp.env import LOOPBACK
from nccl_ddp.errors import ConfigError, NcclDdpError
from nccl_ddp.launch.config import LaunchConfig

log = logging.getLogger("nccl_ddp.launch")

RDZV_BACKENDS = ("c10d", "static")
TORCHRUN_RDZV_PORT = 29400        # torchrun's port when --rdzv-endpoint names a host only


def _nproc(value: str) -> int | str:
    if value in ("auto", "gpu"):
        return "auto"
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an integer nor 'auto' "
                                         f"(or torchrun's 'gpu'/'cpu')") from None


def _nnodes(value: str) -> int:
    """N, or torchrun's MIN:MAX when both are equal (elastic ranges are not supported)."""
    low, _, high = str(value).partition(":")
    try:
        n, m = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a node count (N or N:N)") from None
    if n != m:
        raise argparse.ArgumentTypeError(f"{value!r}: elastic node ranges are not supported; "
                                         f"pass a fixed count, e.g. --nnodes {m}")
    return n


def _flag(p: argparse.ArgumentParser, name: str, **kw) -> None:
    """Add `--a-b` with its underscore twin `--a_b` (torchrun accepts both)."""
    names = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    p.add_argument(*names, dest=name.replace("-", "_"), **kw)


def _endpoint(value: str) -> tuple:
    host, sep, port = value.rpartition(":")
    if not sep or not host:        # a host name alone
        return value, TORCHRUN_RDZV_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint={value!r}: use host:port (e.g. 10.0.0.1:29500)") from None


def parse_args(argv: Optional[Sequence[str]] = None) -> LaunchConfig:
    p = argparse.ArgumentParser(
        prog="nccl-ddp-run", description="Start one nccl_ddp worker per GPU on this node.",
        epilog="Each option falls back to the environment variable shown in its help; torchrun's "
               "spellings (underscores, --rdzv-*) are accepted.")
    env = os.environ.get
    _flag(p, "nproc-per-node", type=_nproc, default=env("NCCL_DDP_NPROC_PER_NODE", "auto"),
          help="workers on this node: an integer or 'auto' (one per GPU, 2 without a GPU) "
               "[NCCL_DDP_NPROC_PER_NODE]")
    _flag(p, "nnodes", type=_nnodes, default=env("NCCL_DDP_NNODES", "1"),
          help="number of nodes (N, or torchrun's N:N) [NCCL_DDP_NNODES]")
    _flag(p, "node-rank", type=int,
          default=env("NCCL_DDP_NODE_RANK", env("GROUP_RANK", env("SLURM_NODEID", 0))),
          help="this node's index, 0..nnodes-1 [NCCL_DDP_NODE_RANK, GROUP_RANK, SLURM_NODEID]")
    _flag(p, "master-addr", default=env("MASTER_ADDR", LOOPBACK),
          help="address of node 0, where the store runs [MASTER_ADDR]")
    _flag(p, "master-port", type=int, default=env("MASTER_PORT", 0),
          help="MASTER_PORT given to the workers (free for the script's own use, e.g. "
               "torch.distributed); 0 picks a free one (single node) [MASTER_PORT]")
    _flag(p, "rdzv-endpoint", default=None,
          help="torchrun's host[:port] of node 0: sets --master-addr and --master-port")
    _flag(p, "rdzv-backend", default="static",
          help=f"accepted for torchrun command lines: one of {RDZV_BACKENDS} (both mean node 0 "
               f"hosts the store)")
    _flag(p, "rdzv-id", default=env("TORCHELASTIC_RUN_ID"),
          help="the job's name, passed on as TORCHELASTIC_RUN_ID")
    _flag(p, "store-port", type=int, default=env("NCCL_DDP_STORE_PORT", 0),
          help="port of our store on node 0; 0: a free one on one node, MASTER_PORT+1 across "
               "nodes [NCCL_DDP_STORE_PORT]")
    _flag(p, "standalone", action="store_true",
          help="single node on loopback with a free port (ignores MASTER_ADDR/PORT)")
    _flag(p, "max-restarts", type=int, default=env("NCCL_DDP_MAX_RESTARTS", 0),
          help="when a worker fails, stop all and start all again, up to N times "
               "[NCCL_DDP_MAX_RESTARTS]")
    _flag(p, "log-dir", default=env("NCCL_DDP_LOG_DIR"),
          help="also write each rank's output to DIR/rank_<R>.log [NCCL_DDP_LOG_DIR]")
    _flag(p, "grace-period", type=float, default=env("NCCL_DDP_GRACE_PERIOD", 5.0),
          help="seconds between SIGTERM and SIGKILL when stopping workers "
               "[NCCL_DDP_GRACE_PERIOD]")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the entrypoint as a module (python -m)")
    p.add_argument("entrypoint", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = p.parse_args(argv)
    if a.rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(f"--rdzv-backend={a.rdzv_backend!r}: use one of {RDZV_BACKENDS} "
                          f"(node 0's launcher hosts the store either way)")
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        addr, port = _endpoint(a.rdzv_endpoint)
    store_port = a.store_port
    if a.standalone:
        addr, port, store_port = LOOPBACK, 0, 0
    return LaunchConfig(entrypoint=a.entrypoint, args=tuple(a.args), module=a.module,
                        nproc_per_node=a.nproc_per_node, nnodes=a.nnodes,
                        node_rank=a.node_rank, master_addr=addr, master_port=port,
                        store_port=store_port, standalone=a.standalone, log_dir=a.log_dir,
                        grace_period=a.grace_period, max_restarts=a.max_restarts,
                        run_id=a.rdzv_id, secret=os.environ.get("NCCL_DDP_SECRET") or None)


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
