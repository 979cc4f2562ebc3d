"""Two launchers on one machine (`--nnodes 2 --node-rank i --master-addr 127.0.0.2`, 2 ranks each)
are two nodes: the world group's all-reduce is hierarchical (shared memory inside each node, TCP
between them), and no segment is shared between the nodes."""

import os
import sys

import pytest
from launch_run import run_together, write_script
from ports import free_port_beside

HIER = """
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group("host", timeout=60)
    g = nd.get_world_group()
    x = np.full(300_001, nd.get_rank() + 1.0, np.float32)
    for _ in range(3):  # staged, then the private array's twin: the same sums
        y = x.copy()
        nd.all_reduce(x if _ == 2 else y)
    nd.all_reduce(x)
    mates = sorted(g._transport.plan.mates) if g.transport_kind == "hier" else None
    print("rank", nd.get_rank(), g.transport_kind, mates, float(x[0]), float(x[-1]), g.cross_node_bytes() > 0)
    nd.destroy_process_group()
"""


@pytest.mark.slow
def test_two_launchers_on_one_machine_run_the_hierarchical_all_reduce(tmp_path):
    script = write_script(tmp_path, HIER)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["NCCL_DDP_SECRET"] = "hier-nodes-test"
    port = str(free_port_beside(1, "127.0.0.2"))
    launch = [sys.executable, "-m", "nccl_ddp.launch", "--nnodes", "2", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.2", "--master-port", port]
    commands = [[*launch, "--node-rank", str(n), script] for n in (0, 1)]
    procs, outs = run_together(commands, [env, env])
    assert [p.returncode for p in procs] == [0, 0], outs
    text = "".join(out for out, _ in outs)
    for rank in range(4):
        mates = [0, 1] if rank < 2 else [2, 3]
        # 1+2+3+4 = 10, then the second all-reduce on x: 40
        assert f"rank {rank} hier {mates} 40.0 40.0 True" in text, text
