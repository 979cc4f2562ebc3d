"""tests/support/torch_fsdp_file.py, the driver of torch's FSDP2 test file, on a test file of our
own in torch's style (tests/support/torch_style_fsdp_tests.py), so that CI checks it without
torch's file: each test is reported as it ends with torch's fully_shard and with ours (a pass, a
failure with its error, a skip, a timeout whose ranks are all killed), the faked accelerator
count is what lets FSDPTest run at all on CPU, and the table and CSV say so."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

import fsdp_torch_tests  # noqa: E402
import torch_fsdp_file as driver  # noqa: E402
from paths import ROOT, SUPPORT  # noqa: E402

SAMPLE = SUPPORT / "torch_style_fsdp_tests.py"
CLS = "TestTorchStyleSample"
# each test of the sample: (with torch's fully_shard, with ours, what a failure's error says)
EXPECTED = {
    "test_train_step_equals_local": ("pass", "pass", ""),
    "test_fully_shard_is_torchs": ("pass", "fail", "fully_shard from nccl_ddp"),  # the ranks ran ours
    "test_planted_failure": ("fail", "fail", "AssertionError: planted failure on rank 1"),
    "test_needs_gpus": ("skip", "skip", ""),  # no allow_cpu: the faked count does not run it
}
RUN = list(EXPECTED)
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    nodes = driver.select(driver.list_tests(SAMPLE), RUN)
    logs = tmp_path_factory.mktemp("torch-fsdp-driver")
    got = driver.run_file(SAMPLE, nodes, ("torch", "ours"), timeout_s=TIMEOUT_S, log_dir=logs)
    return {r.name: r for r in got}


def _results(row) -> dict:
    return {who: o.result for who, o in row.outcomes.items()}


@pytest.mark.slow
@pytest.mark.timeout(8 * TIMEOUT_S)  # the first runs them all (the fixture)
@pytest.mark.parametrize("name", RUN)
def test_each_outcome_is_reported_as_it_was(rows, name):
    torch_result, ours_result, error = EXPECTED[name]
    got = rows[name].outcomes
    assert (got["torch"].result, got["ours"].result) == (torch_result, ours_result), got
    for outcome in got.values():
        if outcome.result == "fail":
            assert error in outcome.detail


@pytest.mark.slow
@pytest.mark.timeout(8 * TIMEOUT_S)
def test_table_and_csv(rows, tmp_path):
    ordered = [rows[n] for n in RUN]
    table = driver.format_table(ordered)
    assert f"{CLS}::test_planted_failure" in table
    assert "torch: 2 of 4 passed" in table and "ours: 1 of 4 passed" in table
    driver.write_csv(ordered, tmp_path / "r.csv")
    with open(tmp_path / "r.csv") as f:
        got = list(csv.DictReader(f))
    assert [(r["test"], r["torch"], r["ours"]) for r in got] == [
        (f"{CLS}::{n}", *_results(rows[n]).values()) for n in RUN
    ]
    assert {r["expected_with_ours"] for r in got} == {"(not in the map)"}


@pytest.mark.slow
def test_without_the_faked_count_fsdptest_skips(tmp_path):
    got = driver.run_test(
        SAMPLE, f"{CLS}::test_train_step_equals_local", "ours", timeout_s=TIMEOUT_S, accel=0
    )
    assert got.result == "skip", got


@pytest.mark.slow
def test_a_hanging_test_times_out_and_leaves_no_process(tmp_path):
    log = tmp_path / "hang.log"
    got = driver.run_test(SAMPLE, f"{CLS}::test_hangs", "ours", timeout_s=20.0, accel=8, log=log)
    assert got.result == "timeout", (got, log.read_text()[-2000:])
    assert got.leftovers >= 1  # pytest at least, and the ranks once spawned
    assert driver.session_members(got.session) == []


def test_a_missing_test_is_reported_missing():
    nodes = driver.select(driver.list_tests(SAMPLE), ["test_planted_failure", "test_nowhere"])
    assert nodes == [f"{CLS}::test_planted_failure", "?::test_nowhere"]
    got = driver.run_test(SAMPLE, nodes[1], "ours", timeout_s=1.0, accel=8)
    assert got.result == "missing" and "test_nowhere" in got.detail


def test_the_file_is_read_not_imported():
    assert driver.list_tests(SAMPLE) == [f"{CLS}::{n}" for n in (*RUN[:3], "test_hangs", RUN[3])]


def test_the_file_from_a_checkout_the_environment_or_nowhere(tmp_path, monkeypatch):
    inside = tmp_path / driver.IN_CHECKOUT
    inside.parent.mkdir(parents=True)
    inside.write_text("")
    assert driver.resolve_file(str(tmp_path)) == inside
    monkeypatch.setenv(driver.ENV_FILE, str(inside))
    assert driver.resolve_file(None) == inside
    monkeypatch.delenv(driver.ENV_FILE)
    with pytest.raises(ValueError, match=driver.ENV_FILE):
        driver.resolve_file(None)
    with pytest.raises(FileNotFoundError, match="no such file"):
        driver.resolve_file(str(tmp_path / "elsewhere"))


def test_a_rank_error_is_read_from_under_fsdptests_wrapper(tmp_path):
    text = (
        "E   RuntimeError: Process 1 exited with error code 10 and exception:\n"
        "E   Traceback (most recent call last):\n"
        'E     File "x.py", line 3, in f\n'
        "E   nccl_ddp.errors.ConfigError: rank 1: not supported\n"
    )
    report = tmp_path / "r.xml"
    case = ET.Element("testcase")
    ET.SubElement(case, "failure", message="RuntimeError: Process 1 exited with error code 10").text = text
    suite = ET.Element("testsuite")
    suite.append(case)
    ET.ElementTree(suite).write(report)
    assert driver.read_junit(report) == driver.Outcome(
        "fail", "nccl_ddp.errors.ConfigError: rank 1: not supported"
    )
    assert driver.read_junit(tmp_path / "none.xml") is None


def test_bad_arguments_are_named(capsys):
    for argv, words in (
        (["--who", "mine", str(SAMPLE)], "--who 'mine'"),
        (["--all", "-k", "x", str(SAMPLE)], "--all and -k"),
        ([os.devnull + "-nowhere"], "no such file"),
    ):
        with pytest.raises(SystemExit):
            driver.main(argv)
        assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="who='mine'"):
        driver.run_test(SAMPLE, f"{CLS}::test_hangs", "mine", timeout_s=1.0, accel=8)


def test_the_map_is_read_by_name():
    assert set(driver.expected_to_pass()) <= set(fsdp_torch_tests.TORCH_TESTS)


def test_the_script_without_a_file_says_where_to_give_one():
    if sys.prefix == sys.base_prefix:
        pytest.skip("the script runs a virtual environment's python; this one is not in one")
    env = {k: v for k, v in os.environ.items() if k != driver.ENV_FILE}
    env["NCCL_DDP_VENV"] = sys.prefix  # this python's (scripts/_venv.sh makes none then)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_torch_fsdp_file.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and driver.ENV_FILE in proc.stderr, proc.stderr


@pytest.mark.slow
def test_torchs_own_limit_is_past_ours_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv(driver.TORCH_TIMEOUT, "8")  # given: torch's limit reports first
    got = driver.run_test(SAMPLE, f"{CLS}::test_hangs", "ours", timeout_s=TIMEOUT_S, accel=8)
    assert got.result == "fail" and "timed out after" in got.detail, got  # not our "timeout"
    assert driver.session_members(got.session) == []
