"""tests/support/mp.py names the root cause first, like the launcher (issue 22 item 13)."""

import os
import signal
import time

import pytest
from mp import RankFailed, run_ranks


def _victim_first(rank, world, how):
    if rank == 0:  # fails at once, blaming rank 1, as a survivor of a dead peer does
        raise RuntimeError("all_reduce failed: peer rank 1 closed the connection")
    time.sleep(1.0)  # the root cause: later, and for a reason of its own
    if how == "raise":
        raise ValueError("rank 1's own mistake")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "SIGKILL"])
def test_root_cause_is_reported_first_not_the_lowest_rank(how):
    # before: "rank 0 failed: ... peer rank 1 closed the connection", and rank 1 was never seen
    with pytest.raises(RankFailed) as e:
        run_ranks(_victim_first, 2, how, timeout=60)
    msg = str(e.value)
    assert msg.startswith("rank 1 failed (root cause; then ranks [0]):\n"), msg
    assert (
        "ValueError: rank 1's own mistake" if how == "raise" else "process killed by signal SIGKILL"
    ) in msg.split("--- then")[0], msg
    assert "--- then rank 0 [blames rank 1]:" in msg and "peer rank 1 closed" in msg, msg


def _one_fails(rank, world):
    if rank == 2:
        raise ValueError("only rank 2")
    return rank


@pytest.mark.slow
def test_a_single_failure_is_reported_with_its_traceback():
    with pytest.raises(RankFailed) as e:
        run_ranks(_one_fails, 3, timeout=60)
    msg = str(e.value)
    assert msg.startswith("rank 2 failed (root cause):\n") and "ValueError: only rank 2" in msg
