"""Runs torch's FSDP2 test file test/distributed/_composable/fsdp/test_fully_shard_training.py
(not in the wheel: from a torch source checkout) with torch's fully_shard and with ours, and
tabulates what passes.

    python tests/support/torch_fsdp_file.py [PATH] [--who torch,ours] [--all | -k NAME ...]

PATH (or $NCCL_DDP_TORCH_FSDP_FILE) is the file or the checkout holding it. Each test runs alone
in its own pytest process and process session, under a timeout; whatever of that session is
still alive afterwards (ranks orphaned by a crash or the timeout) is killed by pid, and the run's
temporary folder (its sitecustomize, TMPDIR and report) removed. The patching is
tests/support/torch_fsdp_patch.py, loaded by every process of the run, ranks included. By default
only the tests tests/support/fsdp_torch_tests.py expects to pass with ours run. The table (test,
torch's result, ours, what the map expects of ours, the map's reason) goes to stdout and to a
CSV, each run's output to a log beside it. No torch code is copied here.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from pathlib import Path

import fsdp_torch_tests
import torch_fsdp_patch

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = "NCCL_DDP_TORCH_FSDP_FILE"
IN_CHECKOUT = Path("test/distributed/_composable/fsdp/test_fully_shard_training.py")
DEFAULT_OUT = ROOT / "out" / "torch_fsdp_file"
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_ACCEL = 8  # the largest world size of torch's file
TORCH_TIMEOUT = "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"  # read by torch's common_distributed
KILL_WAIT_S = 30.0  # for a killed process to be gone (a loaded machine)
# what a rank reads from the launching environment: none of it may leak into torch's own spawning
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SITECUSTOMIZE = """\
# written by nccl_ddp's tests/support/torch_fsdp_file.py for one test run; removed after it
import importlib.util as _u

_spec = _u.spec_from_file_location("_nccl_ddp_torch_fsdp_patch", {patch!r})
_mod = _u.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.apply_from_env()
"""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's run with one fully_shard: `result` is pass, fail, error, skip, timeout, crash
    (no report: pytest itself died) or missing (not in the file); `detail` the error's last line
    or the skip's reason."""

    result: str
    detail: str = ""
    seconds: float = 0.0
    leftovers: int = 0  # processes of the session still alive after pytest ended, killed
    session: int = 0  # the run's process session (its pytest's pid): none of it is left


@dataclasses.dataclass
class Row:
    """A test of the file and its outcomes, by who ran it ("torch", "ours")."""

    node: str  # Class::test
    outcomes: dict[str, Outcome]

    @property
    def name(self) -> str:
        return self.node.rpartition("::")[2]


def resolve_file(where: str | None) -> Path:
    """The test file: `where` (or $NCCL_DDP_TORCH_FSDP_FILE), a file or a torch checkout."""
    where = where or os.environ.get(ENV_FILE)
    if not where:
        raise ValueError(
            f"no test file: give the path of torch's {IN_CHECKOUT.name} (or of a torch source "
            f"checkout) as an argument or in ${ENV_FILE}"
        )
    path = Path(where).expanduser().resolve()
    if path.is_dir():
        path = path / IN_CHECKOUT
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (from {where!r}; a checkout holds {IN_CHECKOUT})")
    return path


def list_tests(path: Path) -> list[str]:
    """ "Class::test" for every test method of the file's classes, in the file's order (read, not
    imported: importing it needs torch's test helpers and takes seconds)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{cls.name}::{fn.name}"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name.startswith("test")
    ]


def expected_to_pass() -> list[str]:
    """The names of torch's tests that fsdp_torch_tests.WITH_OURS expects to pass with ours."""
    return [n for n, why in fsdp_torch_tests.WITH_OURS.items() if why == fsdp_torch_tests.PASS]


def select(nodes: list[str], names: Iterable[str] | None) -> list[str]:
    """The nodes of `names` (test names, or "Class::test"), in the file's order; all if None. A
    name the file lacks is kept as "?::name", reported missing."""
    if names is None:
        return list(nodes)
    wanted = list(names)
    picked = [n for n in nodes if n in wanted or n.rpartition("::")[2] in wanted]
    found = {n.rpartition("::")[2] for n in picked} | set(picked)
    return picked + [f"?::{w.rpartition('::')[2]}" for w in wanted if w not in found]


def session_members(sid: int) -> list[int]:
    """The pids of the live processes of session `sid` (read from /proc; zombies are not)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp session
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def kill_session(sid: int, wait_s: float = KILL_WAIT_S) -> int:
    """SIGKILL to each live process of session `sid`, by pid, until none is left (a process
    that outlives `wait_s` is an error); how many there were at first."""
    first = pids = session_members(sid)
    deadline = time.monotonic() + wait_s
    while pids:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"session {sid}: processes {pids} still alive {wait_s:g} s after SIGKILL")
        time.sleep(0.05)
        pids = session_members(sid)
    return len(first)


_ERROR_LINE = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")
_WRAPPER = re.compile(r"(Process|Thread) \d+ exited with")  # FSDPTest's wrapping of a rank's error


def _last_error_line(text: str) -> str:
    """The last `SomeError: ...` line of a failure's text that is not FSDPTest's wrapper."""
    lines = [m.group(1) for m in map(_ERROR_LINE.match, text.splitlines()) if m]
    lines = [line for line in lines if not _WRAPPER.search(line)] or lines
    return lines[-1][:300] if lines else text.strip().splitlines()[-1][:300] if text.strip() else ""


def read_junit(path: Path) -> Outcome | None:
    """The outcome of the one test of a pytest --junitxml report; None if there is none."""
    if not path.exists():
        return None
    case = ET.parse(path).find(".//testcase")
    if case is None:
        return None
    for tag, result in (("failure", "fail"), ("error", "error"), ("skipped", "skip")):
        el = case.find(tag)
        if el is not None:
            text = el.text or el.get("message") or ""
            detail = (el.get("message") or "")[:300] if tag == "skipped" else _last_error_line(text)
            return Outcome(result, detail)
    return Outcome("pass")


def run_test(
    path: Path, node: str, who: str, *, timeout_s: float, accel: int, log: Path | None = None
) -> Outcome:
    """Runs torch's test `node` ("Class::test") of `path` with `who`'s fully_shard, alone."""
    if who not in torch_fsdp_patch.WHOS:
        raise ValueError(f"who={who!r}: expected one of {', '.join(torch_fsdp_patch.WHOS)}")
    if node.startswith("?::"):
        return Outcome("missing", f"{path.name} has no test {node[3:]}")
    with tempfile.TemporaryDirectory(prefix="nccl-ddp-torch-fsdp-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "site").mkdir()
        (tmp / "tmp").mkdir()
        patch = Path(torch_fsdp_patch.__file__).resolve()
        (tmp / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(patch=str(patch)))
        (tmp / "pytest.ini").write_text("[pytest]\naddopts =\n")  # none of our repository's config
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(tmp / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
                ),
                torch_fsdp_patch.WHO: who,
                torch_fsdp_patch.ACCEL: str(accel),
                "TMPDIR": str(tmp / "tmp"),  # FSDPTest's store files and whatever else: removed
            }
        )
        # torch's own limit per test (300 s) past ours: on a loaded machine an 8-rank test can
        # take longer, and the timeout is ours to report
        env.setdefault(TORCH_TIMEOUT, str(int(timeout_s) + 60))
        report = tmp / "report.xml"
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp / "pytest.ini"),
            "--rootdir", str(tmp), "--confcutdir", str(path.parent), "--junitxml", str(report),
            f"{path}::{node}",
        ]  # fmt: skip
        start = time.monotonic()
        with open(log, "w") if log else open(os.devnull, "w") as out:
            out.write(f"# {who} {node}\n# loadavg: {Path('/proc/loadavg').read_text()}")
            out.flush()
            proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            leftovers = kill_session(proc.pid)
            proc.wait()
            seconds = time.monotonic() - start
            out.write(f"\n# exit {proc.returncode}, {seconds:.1f} s, {leftovers} leftover processes killed\n")
        if timed_out:
            return Outcome("timeout", f"still running after {timeout_s:g} s", seconds, leftovers, proc.pid)
        got = read_junit(report)
        if got is None:
            tail = log.read_text().strip().splitlines()[-2:] if log else []
            detail = f"exit {proc.returncode}, no report: " + " | ".join(tail)
            return Outcome("crash", detail, seconds, leftovers, proc.pid)
        return dataclasses.replace(got, seconds=seconds, leftovers=leftovers, session=proc.pid)


def run_file(
    path: Path,
    nodes: list[str],
    whos: Iterable[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    accel: int = DEFAULT_ACCEL,
    log_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Each of `nodes` run with each of `whos`, one at a time."""
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for node in nodes:
        row = Row(node, {})
        for who in whos:
            log = log_dir / f"{who}__{node.replace('::', '__')}.log" if log_dir else None
            got = row.outcomes[who] = run_test(path, node, who, timeout_s=timeout_s, accel=accel, log=log)
            if progress:
                progress(f"{who:5} {got.result:7} {got.seconds:6.1f}s  {node}  {got.detail}")
        rows.append(row)
    return rows


COLUMNS = ("test", "torch", "ours", "expected_with_ours", "reason", "torch_detail", "ours_detail", "seconds")


def _fields(row: Row) -> dict[str, str]:
    def result(who: str) -> str:
        return row.outcomes[who].result if who in row.outcomes else ""

    def detail(who: str) -> str:
        return row.outcomes[who].detail if who in row.outcomes else ""

    return {
        "test": row.node,
        "torch": result("torch"),
        "ours": result("ours"),
        "expected_with_ours": fsdp_torch_tests.WITH_OURS.get(row.name, "(not in the map)"),
        "reason": fsdp_torch_tests.TORCH_TESTS.get(row.name, ""),
        "torch_detail": detail("torch"),
        "ours_detail": detail("ours"),
        "seconds": " ".join(f"{w}={o.seconds:.0f}" for w, o in row.outcomes.items()),
    }


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(_fields(r) for r in rows)


def format_table(rows: list[Row]) -> str:
    """The table for a terminal: a line per test, its failures' errors on the lines under it."""
    fields = [_fields(r) for r in rows]
    width = max([len(f["test"]) for f in fields] + [4])
    lines = [f"{'test':{width}}  {'torch':7}  {'ours':7}  expected with ours / reason"]
    for f in fields:
        expected = f["expected_with_ours"]
        lines.append(f"{f['test']:{width}}  {f['torch'] or '-':7}  {f['ours'] or '-':7}  {expected}")
        if f["reason"] and f["reason"] != expected:
            lines.append(f"{'':{width + 20}}our tests: {f['reason']}")
        for who in ("torch", "ours"):
            if f[who] not in ("", "pass") and f[f"{who}_detail"]:
                lines.append(f"{'':{width + 20}}{who}: {f[f'{who}_detail']}")
    for who in ("torch", "ours"):
        ran = [f[who] for f in fields if f[who]]
        if ran:
            lines.append(f"{who}: {ran.count('pass')} of {len(ran)} passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help=f"the test file or a torch checkout (default ${ENV_FILE})")
    parser.add_argument("--who", default="torch,ours", help="whose fully_shard: torch, ours or both")
    parser.add_argument("--all", action="store_true", help="every test of the file, not only the expected")
    parser.add_argument("-k", dest="names", action="append", help="a test (name or Class::name); repeatable")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per test and run")
    parser.add_argument("--accel", type=int, default=DEFAULT_ACCEL, help="the faked accelerator count")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of results.csv and logs/")
    args = parser.parse_args(argv)
    whos = [w.strip() for w in args.who.split(",") if w.strip()]
    bad = [w for w in whos if w not in torch_fsdp_patch.WHOS]
    if bad or not whos:
        parser.error(f"--who {args.who!r}: a comma-separated list of {', '.join(torch_fsdp_patch.WHOS)}")
    if args.all and args.names:
        parser.error("--all and -k: choose one")
    try:
        path = resolve_file(args.path)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    names = None if args.all else args.names or expected_to_pass()
    nodes = select(list_tests(path), names)
    print(f"{path}: {len(nodes)} tests, fully_shard of {' then '.join(whos)}", flush=True)
    rows: list[Row] = []
    for node in nodes:  # the CSV rewritten after each test: an interrupted run keeps what it ran
        rows += run_file(
            path,
            [node],
            whos,
            timeout_s=args.timeout,
            accel=args.accel,
            log_dir=args.out / "logs",
            progress=lambda line: print(line, flush=True),
        )
        write_csv(rows, args.out / "results.csv")
    print(format_table(rows))
    print(f"CSV: {args.out / 'results.csv'}; logs: {args.out / 'logs'}")
    return 0 if all(o.result == "pass" for r in rows for o in r.outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
