"""torch.distributed's backend names work in `nd.init_process_group(backend=...)`: scripts pass
them through ("gloo" on the CPU, nanoGPT's "nccl", `dist.get_backend()`'s "cpu:gloo,cuda:nccl")."""

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.comm.backends import backend_name


@pytest.mark.parametrize(
    "given, ours",
    [
        (None, None),
        ("host", "host"),
        ("gloo", "host"),
        ("GLOO", "host"),
        ("nccl", "nccl"),
        ("cpu:gloo", "host"),
        ("cuda:nccl", "nccl"),
        ("cpu:gloo,cuda:nccl", None),
        ("cuda:nccl, cpu:gloo", None),
    ],
)
def test_torch_backend_names_map_to_ours(given, ours):
    assert backend_name(given) == ours


def _job(rank, world, backend):
    group = nd.init_process_group(backend=backend)
    try:
        x = np.full(4, rank + 1.0, np.float32)
        nd.all_reduce(x)
        return group.backend, float(x[0])
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_init_process_group_with_torch_backend_name(backend):
    out = run_ranks(_job, 2, backend, timeout=120)
    if backend != "gloo" and out[0][0] == "nccl":
        pytest.skip("a GPU is here: the automatic choice is nccl")
    assert out == [("host", 3.0)] * 2
