"""`nccl-ddp-run --nnodes 2 --master-addr 127.0.0.1` on one machine, as torchrun takes it: the usual
way to try a multi-node job before there are two nodes; with 2 ranks each (127.0.0.2) the two are
two nodes to the host backend too: its all-reduce runs hierarchically."""

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


def _two_launchers(tmp_path, body, nproc, addr):
    """`body` run by two launchers (--nnodes 2, node ranks 0 and 1) of `nproc` ranks each on
    `addr`; returns their outputs once both exited 0."""
    script = write_script(tmp_path, body)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["NCCL_DDP_SECRET"] = "loopback-nodes-test"
    port = str(free_port_beside(1, addr))
    launch = [sys.executable, "-m", "nccl_ddp.launch", "--nnodes", "2", "--nproc-per-node", str(nproc)]
    launch += ["--master-addr", addr, "--master-port", port]
    commands = [[*launch, "--node-rank", str(n), script] for n in (0, 1)]
    procs, outs = run_together(commands, [env, env])
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


@pytest.mark.slow
def test_two_nodes_on_loopback_run_as_under_torchrun(tmp_path):
    # before: both launchers exited 2 with "a multi-node job needs --master-addr", which was given
    outs = _two_launchers(tmp_path, ALL_REDUCE, 1, "127.0.0.1")
    for n, (out, _) in enumerate(outs):
        assert f"[rank {n}] rank {n} of 2 [3.0, 3.0, 3.0]" in out, out


HIER = """
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group("host", timeout=60)
    g = nd.get_world_group()
    x = np.full(300_001, nd.get_rank() + 1.0, np.float32)
    for i in range(3):  # a private array: staged at its first op, then through its twin
        nd.all_reduce(x if i == 2 else x.copy())
    nd.all_reduce(x)
    mates = sorted(g._transport.plan.mates) if g.transport_kind == "hier" else None
    print("rank", nd.get_rank(), g.transport_kind, mates, float(x[0]), float(x[-1]), g.cross_node_bytes() > 0)
    nd.destroy_process_group()
"""


@pytest.mark.slow
def test_two_launchers_of_two_ranks_run_the_hierarchical_all_reduce(tmp_path):
    """Two launchers on one machine are two nodes: the world group's all-reduce is hierarchical
    (shared memory inside each node, TCP between them), each node's shm its own ranks only."""
    text = "".join(out for out, _ in _two_launchers(tmp_path, HIER, 2, "127.0.0.2"))
    for rank in range(4):
        mates = [0, 1] if rank < 2 else [2, 3]
        assert f"rank {rank} hier {mates} 40.0 40.0 True" in text, text  # 1+2+3+4, then x 4
