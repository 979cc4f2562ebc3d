"""DDP and the grad reducer on CuPy arrays over NCCL (one GPU: world size 1, NCCL refuses two ranks
on one device). Checks the CUDA path end to end: bucket views, fused pack/scale kernels, streams."""

import os
import subprocess
import sys

import numpy as np
import pytest
from mp import run_ranks
from paths import ROOT
from reducer_cases import FLAGS, SHAPES, local_grads, make_params

pytestmark = pytest.mark.gpu


def _flags_on_gpu(rank, world):
    import cupy as cp

    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("nccl", timeout=60.0)
    out = {}
    try:
        for flags in FLAGS:
            avg, mode, static, unused = flags
            model = ArrayModule({k: cp.asarray(v) for k, v in make_params().items()})
            ddp = nd.DistributedDataParallel(
                model,
                bucket_cap_mb=200 / 2**20,
                average_in_collective=avg,
                reducer_mode=mode,
                static_graph=static,
                find_unused_parameters=unused,
            )
            res = []
            for step in range(2):
                g = local_grads(rank, step)
                for k in reversed(list(g)):
                    ddp.mark_ready(k, cp.asarray(g[k]))
                res.append({k: cp.asnumpy(v).astype(np.float64) for k, v in model.grads.items()})
                ddp.zero_grad()
            out[flags] = (res, ddp.reducer.mode)
            ddp.close()
        red = nd.DistributedGradReducer([cp.asarray(v) for v in make_params().values()], degree=4)
        reduced = [cp.asnumpy(r) for r in red([cp.asarray(v) for v in local_grads(0, 0).values()])]
    finally:
        nd.destroy_process_group()
    return out, reduced


def test_ddp_flag_matrix_on_gpu():
    out, reduced = run_ranks(_flags_on_gpu, 1, timeout=300)[0]
    for flags, (res, mode) in out.items():
        assert mode == ("per_grad" if flags[1] == "PythonReducer" else "view")
        for step in range(2):
            for k, _ in zip(res[step], SHAPES):
                want = local_grads(0, step)[k].astype(np.float64)
                np.testing.assert_allclose(res[step][k], want, rtol=2e-3, atol=2e-3, err_msg=f"{flags} {k}")
    for r, g in zip(reduced, local_grads(0, 0).values()):
        np.testing.assert_allclose(r.astype(np.float64), g.astype(np.float64) / 4, rtol=2e-3, atol=1e-3)


def test_train_mlp_on_gpu():
    example = os.path.join(ROOT, "examples", "train_mlp.py")
    r = subprocess.run(
        [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "1", example, "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 1 ranks hold identical parameters" in r.stdout
