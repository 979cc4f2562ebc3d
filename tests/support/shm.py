"""`no_shm_leaks`: an autouse fixture for the host backend's tests (import it into the module):
the test fails when it leaves a shared-memory segment of ours in /dev/shm."""

import os

import pytest


def shm_entries() -> set:
    """Our segments in /dev/shm now."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("nccl_ddp-")}


@pytest.fixture(autouse=True)
def no_shm_leaks():
    before = shm_entries()
    yield
    assert shm_entries() - before == set(), "shared-memory segments left in /dev/shm"
