"""The `nccl-ddp-run` command line: the parsed flags (launch/parser.py) read into one LaunchConfig.

`--rdzv-endpoint host:port` sets the master address and port; `--standalone` loopback and a free
port. torchrun flags that have no meaning here are accepted with a one-line notice.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from typing import Optional, Sequence

from nccl_ddp.errors import ConfigError, NcclDdpError
from nccl_ddp.job.env import LOOPBACK
from nccl_ddp.launch.config import LaunchConfig
from nccl_ddp.launch.logs import parse_std
from nccl_ddp.launch.parser import RDZV_BACKENDS, build_parser
from nccl_ddp.launch.supervisor import parse_signals

log = logging.getLogger("nccl_ddp.launch")

TORCHRUN_RDZV_PORT = 29400  # torchrun's port when --rdzv-endpoint names a host only


def _endpoint(value: str) -> tuple:
    host, sep, port = value.rpartition(":")
    if not sep or not host:  # a host name alone
        return value, TORCHRUN_RDZV_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint={value!r}: use host:port (e.g. 10.0.0.1:29500)") from None


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
    a = build_parser().parse_args(argv)
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
