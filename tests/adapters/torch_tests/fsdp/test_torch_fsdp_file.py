"""torch's own FSDP2 tests, test/distributed/_composable/fsdp/test_fully_shard_training.py of
torch v2.13.0, with our fully_shard patched in for torch's (issue 42).

The file is not in the wheel, and CI reaches only package registries: these tests run where
NCCL_DDP_TORCH_FSDP_FILE names a copy (or a torch source checkout), and skip elsewhere. Each test
of the file runs alone through tests/support/torch_fsdp_file.py (its own process session and
timeout, the accelerator count faked). By default only those tests/support/fsdp_torch_tests.py's
WITH_OURS expects to pass with ours run, and each must pass; NCCL_DDP_TORCH_FSDP_ALL=1 runs every
one: those expected to fail are reported xfail, and one that passes fails here (mark it PASS).
The table of both fully_shards: `python tests/support/torch_fsdp_file.py PATH` (docs/zero.md).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

import fsdp_torch_tests  # noqa: E402
import torch_fsdp_file as driver  # noqa: E402

WHERE = os.environ.get(driver.ENV_FILE, "")
ALL = os.environ.get("NCCL_DDP_TORCH_FSDP_ALL") == "1"
NAMES = list(fsdp_torch_tests.WITH_OURS) if ALL else driver.expected_to_pass()
TIMEOUT_S = driver.DEFAULT_TIMEOUT_S


@pytest.fixture(scope="module")
def torch_file():
    if not WHERE:
        pytest.skip(
            f"torch's {driver.IN_CHECKOUT.name} is not in the wheel (nor in CI): set "
            f"{driver.ENV_FILE} to a copy of it or to a torch source checkout to run it"
        )
    path = driver.resolve_file(WHERE)
    return path, driver.list_tests(path)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", NAMES)
def test_torchs_fsdp_test_with_ours(torch_file, name):
    path, nodes = torch_file
    [node] = driver.select(nodes, [name])
    got = driver.run_test(path, node, "ours", timeout_s=TIMEOUT_S, accel=driver.DEFAULT_ACCEL)
    expected = fsdp_torch_tests.WITH_OURS[name]
    if expected == fsdp_torch_tests.PASS:
        assert got.result == "pass", f"{node} with ours: {got.result}: {got.detail}"
    elif got.result == "pass":
        pytest.fail(f"{node} passes with ours now: make it PASS in fsdp_torch_tests.WITH_OURS")
    elif got.result in ("skip", "missing"):
        pytest.skip(f"{got.result}: {got.detail}")
    else:
        pytest.xfail(f"{expected} ({got.result}: {got.detail})")


def test_every_test_of_the_map_says_what_it_does_with_ours():
    assert list(fsdp_torch_tests.WITH_OURS) == list(fsdp_torch_tests.TORCH_TESTS)
    assert all(why for why in fsdp_torch_tests.WITH_OURS.values())
    expected = driver.expected_to_pass()
    assert expected and len(expected) < len(fsdp_torch_tests.WITH_OURS)
