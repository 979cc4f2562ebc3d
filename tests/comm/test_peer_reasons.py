"""A rank that fails because a peer failed names the peer and the peer's reason: a rank that
leaves on an exception (uncaught, or with destroy_process_group in a finally block) tells its
peers why before its sockets close. Two scripts with a hand-set environment (as torchrun or a
batch system gives it), no launcher of ours."""

import os
import sys

import pytest
from launch_run import run_together, write_script
from mp import free_port

LEAVES = """
    import sys
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group("host", timeout=60)
    nd.all_reduce(np.ones(4, np.float32))
    if nd.get_rank() == 1:
        if sys.argv[1] == "uncaught":
            raise ValueError("backward_passes_per_step is 2 here and 1 on rank 0")
        try:
            raise ValueError("backward_passes_per_step is 2 here and 1 on rank 0")
        finally:
            nd.destroy_process_group()
    try:
        nd.all_reduce(np.ones(4, np.float32))
        print("RESULT ok")
    except Exception as e:
        print("RESULT", type(e).__name__, e)
    nd.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["uncaught", "finally"])
def test_a_rank_failing_because_of_its_peer_names_the_peer_and_why(tmp_path, how):
    # before: rank 0 said "peer rank 1 closed the connection (did it die or fail? check its log)"
    script = write_script(tmp_path, LEAVES)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_DDP_", "MASTER_"))}
    base.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    envs = [dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2") for r in (0, 1)]
    procs, outs = run_together([[sys.executable, script, how]] * 2, envs)
    (line,) = [x for x in outs[0][0].splitlines() if x.startswith("RESULT")] or [outs[0]]
    assert line.startswith("RESULT CommError") and "peer rank 1 gave up: rank 1 " in line, line
    assert "ValueError: backward_passes_per_step is 2 here and 1 on rank 0" in line, line
    assert procs[1].returncode == 1 and "ValueError: backward_passes_per_step" in outs[1][1], outs[1]
