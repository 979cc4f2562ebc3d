"""scripts/bench_2nodes_netns.sh: two nodes in network namespaces joined by a paced veth (or one
per local rank, --rails 2) run the hierarchical all-reduce, the flat ring and gloo over it, and
leave no namespace behind. Needs
root, ip and tc (skipped otherwise)."""

import os
import re
import shutil
import subprocess

import pytest
from paths import ROOT

pytestmark = pytest.mark.slow


def _namespaces() -> set:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


NETNS = os.geteuid() == 0 and bool(shutil.which("ip") and shutil.which("tc"))


@pytest.mark.skipif(not NETNS, reason="needs root, ip and tc")
@pytest.mark.parametrize("rails", [1, 2])
def test_two_namespaces_cross_a_paced_link(tmp_path, rails):
    try:
        before = _namespaces()
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"ip netns unusable here: {e}")
    args = ["--min", "1M", "--max", "1M", "--iters", "2", "--warmup", "1", "--limit-min", "0", "--png", ""]
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "bench_2nodes_netns.sh"), "--rate", "2gbit"]
        + ["--rails", str(rails), "--", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OUT_DIR=str(tmp_path)),
    )
    if r.returncode != 0 and "Operation not permitted" in r.stderr:
        pytest.skip("network namespaces are not permitted here")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [re.sub(r"^\[rank \d+\] ", "", line) for line in r.stdout.splitlines()]
    head = next(line.split() for line in lines if "cross_MiB" in line)
    row = next(line.split() for line in lines if "float32" in line)
    values = dict(zip(head[1:], row[2:]))  # (the size, "1 MiB", is two words)
    cross, flat = float(values["cross_MiB"]), float(values["flat_cross_MiB"])
    assert cross == pytest.approx(flat / 3)  # 2 nodes x 2 ranks: 1/3 of the ring's most loaded rank
    assert _namespaces() == before
