"""`nccl-ddp-run --nnodes 2 --master-addr 127.0.0.1` on one machine, as torchrun takes it: the usual
way to try a multi-node job before there are two nodes."""

import os
import sys

import pytest
from launch_run import run_together, write_script
from ports import free_port_beside

ALL_REDUCE = """
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group("host", timeout=30)
    x = nd.all_reduce(np.full(3, nd.get_rank() + 1.0, np.float32))
    print("rank", nd.get_rank(), "of", nd.get_world_size(), x.tolist())
    nd.destroy_process_group()
"""


@pytest.mark.slow
def test_two_nodes_on_loopback_run_as_under_torchrun(tmp_path):
    # before: both launchers exited 2 with "a multi-node job needs --master-addr", which was given
    script = write_script(tmp_path, ALL_REDUCE)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["NCCL_DDP_SECRET"] = "loopback-nodes-test"
    port = str(free_port_beside(1))
    launch = [sys.executable, "-m", "nccl_ddp.launch", "--nnodes", "2", "--nproc-per-node", "1"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", port]
    commands = [[*launch, "--node-rank", str(n), script] for n in (0, 1)]
    procs, outs = run_together(commands, [env, env])
    assert [p.returncode for p in procs] == [0, 0], outs
    for n, (out, _) in enumerate(outs):
        assert f"[rank {n}] rank {n} of 2 [3.0, 3.0, 3.0]" in out, out
