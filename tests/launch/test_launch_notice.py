"""nccl-ddp-run says once, at WARNING, when a job finished without any worker initialising
nccl_ddp: a transformers Trainer / Lightning "ddp" / torch script launched with it alone keeps
torch's DDP, which would otherwise look like ours. A job that used ours gets no such line."""

import pytest
from launch_run import TORCH_EXIT, run_launcher, write_script

NOTICE = "no worker initialised nccl_ddp"

TORCH_DDP_ONLY = (
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    print("grad", model.module.bias.grad.tolist())
    dist.destroy_process_group()
"""
    + TORCH_EXIT
)  # not torch's teardown, which aborts now and then (launch_run.TORCH_EXIT)

OURS = """
    import numpy as np
    import nccl_ddp as nd
    nd.init_process_group()
    x = np.ones(2, np.float32)
    nd.all_reduce(x)
    print("sum", x.tolist())
    nd.destroy_process_group()
"""


@pytest.mark.slow
def test_a_job_that_kept_torch_ddp_is_told_once(tmp_path):
    pytest.importorskip("torch")
    res = run_launcher(["--nproc-per-node", "2", write_script(tmp_path, TORCH_DDP_ONLY)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[rank 1] grad [3.0, 3.0]" in res.stdout
    assert res.stderr.count(NOTICE) == 1, res.stderr
    assert "from nccl_ddp.transformers import Trainer" in res.stderr


@pytest.mark.slow
def test_a_job_that_used_ours_is_not(tmp_path):
    res = run_launcher(["--nproc-per-node", "2", write_script(tmp_path, OURS)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[rank 0] sum [2.0, 2.0]" in res.stdout
    assert NOTICE not in res.stderr
