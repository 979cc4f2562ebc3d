"""`horovodrun` (also `nccl-ddp-horovodrun`): Horovod's launcher command line, run by nccl-ddp-run.

    horovodrun -np 4 -H localhost:4 python train.py --epochs 3
    horovodrun -np 2 --hostfile hosts.txt python train.py     # lines "host slots=N" or "host:N"

One host only: the ranks run on this machine, so every host named must be this one (localhost,
127.0.0.1, its name) and `-np` must fit its slots. For several nodes, start `nccl-ddp-run
--nnodes N --node-rank i --master-addr HOST0 ...` on each (docs/launch.md). A command that starts
with `python` runs the script with nccl-ddp-run's Python; any other runs as is (--no-python).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import List, Optional, Sequence, Tuple

from nccl_ddp.errors import ConfigError, NcclDdpError

log = logging.getLogger("nccl_ddp.launch.horovodrun")

_LOCAL = {"localhost", "127.0.0.1", "::1"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="horovodrun",
        description="Horovod's launcher command line on nccl_ddp (one node): starts -np workers "
        "with nccl-ddp-run.",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of workers")
    p.add_argument("-H", "--hosts", dest="hosts", help="host:slots[,host:slots] (this host only)")
    p.add_argument(
        "-hostfile", "--hostfile", dest="hostfile", help="file of 'host slots=N' or 'host:N' lines"
    )
    p.add_argument(
        "--fusion-threshold-mb", type=int, help="bucket cap in MiB (sets HOROVOD_FUSION_THRESHOLD)"
    )
    p.add_argument("--start-timeout", type=int, help="accepted: every wait is bounded by the group's timeout")
    p.add_argument("--verbose", action="store_true", help="log the nccl-ddp-run command")
    p.add_argument("--gloo", action="store_true", help="accepted: nccl_ddp has its own transports")
    p.add_argument("--mpi", action="store_true", help="accepted: nccl_ddp has its own transports")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, e.g. python train.py")
    return p


def _slots(spec: str, where: str) -> Tuple[str, int]:
    host, sep, slots = spec.strip().rpartition(":")
    if not sep:
        return spec.strip(), 1
    try:
        return host, int(slots)
    except ValueError:
        raise ConfigError(f"{where}: {spec!r} is not host:slots (e.g. localhost:4)") from None


def parse_hosts(hosts: Optional[str], hostfile: Optional[str]) -> List[Tuple[str, int]]:
    """(host, slots) from -H or --hostfile (None: this node with unlimited slots)."""
    if hosts and hostfile:
        raise ConfigError("horovodrun: pass -H or --hostfile, not both")
    if hosts:
        return [_slots(h, "-H") for h in hosts.split(",") if h.strip()]
    if not hostfile:
        return []
    out = []
    try:
        with open(hostfile) as f:
            lines = [ln.split("#")[0].strip() for ln in f]
    except OSError as e:
        raise ConfigError(f"horovodrun: cannot read --hostfile {hostfile!r}: {e}") from e
    for ln in filter(None, lines):
        host, _, rest = ln.partition(" ")
        if "slots=" in rest:
            try:
                out.append((host, int(rest.split("slots=")[1].split()[0])))
            except ValueError:
                raise ConfigError(f"horovodrun: --hostfile line {ln!r}: slots= must be a number") from None
        else:
            out.append(_slots(host, f"--hostfile line {ln!r}"))
    return out


def _is_this_node(host: str) -> bool:
    return host in _LOCAL or host in (socket.gethostname(), socket.getfqdn())


def to_nccl_ddp_run(argv: Sequence[str]) -> Tuple[List[str], dict]:
    """nccl-ddp-run's arguments and the extra environment for a horovodrun command line."""
    a = _parser().parse_args(list(argv))
    if a.np < 1:
        raise ConfigError(f"horovodrun: -np must be >= 1, got {a.np}")
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise ConfigError("horovodrun: no command given; e.g. horovodrun -np 2 python train.py")
    hosts = parse_hosts(a.hosts, a.hostfile)
    others = sorted({h for h, _ in hosts if not _is_this_node(h)})
    if others:
        raise ConfigError(
            f"horovodrun: hosts {others} are not this machine; this launcher starts workers on one "
            "node only: run `nccl-ddp-run --nnodes N --node-rank i --master-addr HOST0 "
            "--nproc-per-node SLOTS script.py` on each node (docs/launch.md)"
        )
    slots = sum(s for _, s in hosts)
    if hosts and a.np > slots:
        raise ConfigError(f"horovodrun: -np {a.np} is more than the {slots} slots of {a.hosts or a.hostfile}")
    env = {}
    if a.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(a.fusion_threshold_mb * 2**20)
    for flag, given in (
        ("--start-timeout", a.start_timeout is not None),
        ("--gloo", a.gloo),
        ("--mpi", a.mpi),
    ):
        if given:
            log.warning("%s has no effect: nccl_ddp brings its own rendezvous, transports and timeouts", flag)
    args = ["--nproc-per-node", str(a.np), "--nnodes", "1"]
    if os.path.basename(command[0]).startswith("python"):
        rest = command[1:]
        if rest[:1] == ["-m"]:
            args += ["-m"]
            rest = rest[1:]
        args += rest
    else:
        args += ["--no-python", *command]
    if a.verbose:
        log.info("nccl-ddp-run %s", " ".join(args))
    return args, env


def main(argv: Optional[Sequence[str]] = None) -> None:
    from nccl_ddp.launch.cli import main as run

    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("horovodrun: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        args, env = to_nccl_ddp_run(sys.argv[1:] if argv is None else argv)
    except NcclDdpError as e:
        log.error("%s", e)
        sys.exit(2)
    os.environ.update(env)
    run(args)


if __name__ == "__main__":
    main()
