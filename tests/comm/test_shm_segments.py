"""The shm transport's segments never have a name in /dev/shm: a rank SIGKILLed during start-up,
without our launcher (run_ranks sets the environment by hand, as torchrun or mp.spawn would),
leaves nothing behind, and its peer's setup fails naming it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.comm.host import segment
from nccl_ddp.errors import CommError

SHM = {"NCCL_DDP_HOST_TRANSPORT": "shm"}


def _killed_in_setup(rank, world, out, when):
    """Rank 0 dies by SIGKILL inside init_process_group with its segment created: right after
    creating it, or after sending its handle and before rank 1 mapped it (rank 1 maps only once
    rank 0 is gone)."""
    real_create, real_attach = segment.Segment.create, getattr(segment.Segment, "attach", None)

    def create(*args, **kwargs):
        seg = real_create(*args, **kwargs)
        with open(os.path.join(out, "created"), "w") as f:
            f.write(f"{os.getpid()} {seg.array.size}")
        if when == "created":
            os.kill(os.getpid(), signal.SIGKILL)
        return seg

    def attach(handle, nbytes, peer):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 1 has the handle, has not mapped it
        pid, fd = handle.split(":")[:2]
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{pid}/fd/{fd}") and time.monotonic() < deadline:
            time.sleep(0.02)
        return real_attach(handle, nbytes, peer)

    if rank == 0:
        segment.Segment.create = create
    if when == "sent":
        segment.Segment.attach = attach
    try:
        nd.init_process_group("host", timeout=20)
    except CommError as e:
        return "CommError", str(e)
    nd.destroy_process_group()
    return "ok", None


@pytest.mark.slow
@pytest.mark.parametrize("when", ["created", "sent"])
def test_a_rank_killed_between_creating_and_sharing_its_segment_leaves_nothing(tmp_path, when):
    # before: /dev/shm/nccl_ddp-host-<pid>-* of the killed rank stayed (only our launcher's reaper
    # removed segments, by its job's prefix)
    failed = run_ranks(_killed_in_setup, 2, str(tmp_path), when, timeout=60, env=SHM, expect_fail=True)
    pid, nbytes = (int(x) for x in (tmp_path / "created").read_text().split())
    assert nbytes > 0
    assert set(failed) == {0} and "SIGKILL" in failed[0], failed
    left = [n for n in os.listdir(segment.SHM_DIR) if f"-{pid}-" in n]
    assert left == [], f"segments of the killed rank (pid {pid}) outlived it: {left}"


@pytest.mark.slow
def test_the_peer_of_a_rank_killed_in_shm_setup_fails_naming_it(tmp_path):
    failed = run_ranks(_killed_in_setup_peer_report, 2, str(tmp_path), timeout=60, env=SHM, expect_fail=True)
    assert set(failed) == {0}, failed
    kind, msg = (tmp_path / "peer").read_text().split("\n", 1)
    assert kind == "CommError" and "peer rank 0" in msg, (kind, msg)
    assert "exited during setup" in msg, msg


def _killed_in_setup_peer_report(rank, world, out):
    kind, msg = _killed_in_setup(rank, world, out, "sent")
    with open(os.path.join(out, "peer"), "w") as f:
        f.write(f"{kind}\n{msg}")
