"""What a host-backend job imports: a float32 job on a machine without a GPU driver never loads
CuPy or ml_dtypes (together 0.6-4 s a process), only a bfloat16 array brings ml_dtypes in."""

import sys

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.device.cuda import driver_present


def _float32_job(rank, world):
    if driver_present():  # a fresh process: only a real CUDA driver says yes
        return "driver"
    nd.init_process_group()  # backend auto: host on a machine without a driver
    try:
        x = np.full(8, rank + 1.0, np.float32)
        nd.all_reduce(x)
        return float(x[0]), "ml_dtypes" in sys.modules, "cupy" in sys.modules
    finally:
        nd.destroy_process_group()


def _bfloat16_job(rank, world):
    from nccl_ddp.arrays.dlpack import bfloat16_dtype

    nd.init_process_group()
    try:
        x = np.full(8, rank + 1.0, np.float32).astype(bfloat16_dtype())
        nd.all_reduce(x)
        return float(x[0].astype(np.float32))
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_float32_host_job_never_imports_ml_dtypes_or_cupy():
    out = run_ranks(_float32_job, 2, timeout=120, fresh=True)
    if "driver" in out:
        pytest.skip("a CUDA driver is installed: the auto backend asks CuPy for a GPU")
    assert out == [(3.0, False, False)] * 2


@pytest.mark.slow
def test_bfloat16_host_job_loads_ml_dtypes_when_it_needs_it():
    pytest.importorskip("ml_dtypes")
    assert run_ranks(_bfloat16_job, 2, timeout=120, fresh=True) == [3.0, 3.0]
