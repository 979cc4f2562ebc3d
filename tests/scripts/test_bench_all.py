"""scripts/bench_all.sh (the one command behind docs/benchmarks.md): every table's command line
parses with its script's own parser, in the full and the quick run, so the long run cannot fail
on an argument; and the markdown tables it collects."""

import importlib.util
import os
import subprocess
import sys

import pytest
from paths import ROOT

SCRIPTS = os.path.join(ROOT, "scripts")
VENVS = {".venv/bin/python", ".venv-tf/bin/python", ".venv-paddle/bin/python", ".venv-ms/bin/python"}


def _tables(*flags):
    r = subprocess.run(
        ["bash", os.path.join(SCRIPTS, "bench_all.sh"), "--dry-run", "--out", "/nonexistent/x", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [line.split("\t") for line in r.stdout.splitlines()]


def _script(path):
    sys.path.insert(0, SCRIPTS)
    name = "bench_all_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--quick",)], ids=["full", "quick"])
def test_every_table_command_parses(flags):
    tables = _tables(*flags)
    names = [t[0] for t in tables]
    assert len(names) == len(set(names)) >= 14
    for want in ("allreduce_2ranks", "allreduce_3ranks", "ddp_12m", "zero", "paddle", "tf", "jax_jit"):
        assert want in names
    for name, py, script, *args in tables:
        assert py in VENVS, (name, py)
        ns = _script(script).parse_args(args)  # SystemExit (argparse) on a bad flag
        keys = ("params_csv", "params_png") if getattr(ns, "many_params", False) else ("csv", "png")
        for key in keys:
            value = getattr(ns, key, None)
            assert not value or value.startswith("/nonexistent/x/"), (name, key, value)


def test_only_selects_tables():
    assert [t[0] for t in _tables("--only", "zero,paddle")] == ["zero", "paddle"]


def test_unknown_argument_is_refused():
    cmd = ["bash", os.path.join(SCRIPTS, "bench_all.sh"), "--fast"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown argument --fast" in r.stderr


def test_markdown_tables(monkeypatch):
    benchlib = _script("scripts/benchlib.py")
    rows = [dict(size="16 MiB", ms=1.234, note=""), dict(size="1 GiB", ms=10.0)]
    assert benchlib.markdown_table(rows, ["size", "ms", "note"], {"ms": ".2f"}).splitlines() == [
        "| size | ms | note |",
        "|---|---:|---|",
        "| 16 MiB | 1.23 |  |",
        "| 1 GiB | 10.00 |  |",
    ]
    text = benchlib.format_table(rows, ["size", "ms"], {"ms": ".1f"})
    assert text.splitlines()[1].split() == ["16", "MiB", "1.2"]
    monkeypatch.setenv("NCCL_DDP_BENCH_MARKDOWN", "1")
    assert benchlib.format_table(rows, ["size", "ms"], {"ms": ".1f"}).startswith("| size | ms |")


@pytest.mark.slow
def test_a_table_beside_a_busy_process_is_marked_loaded(tmp_path):
    # before: only the 1-minute load average was checked (>= 1.5), which a process that keeps a core
    # busy for the length of a short table does not reach, while the previous table's own ranks
    # pushed it over for every later table; now the cores others keep busy, measured around it
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        r = subprocess.run(
            ["bash", os.path.join(SCRIPTS, "bench_all.sh"), "--quick", "--only", "allreduce_2ranks"]
            + ["--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
    finally:
        spin.kill()
        spin.wait()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "cores busy with other processes before" in summary
    assert "**LOADED (other processes kept >= 0.5 cores busy)" in summary, summary
