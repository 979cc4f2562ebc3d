"""nccl_ddp.fully_shard (ZeRO-3) against our own ZeRO-2 (DistributedDataParallel built with
zero=ZeroConfig(stage=2) + ZeroRedundancyOptimizer), 2 ranks, 6 steps, plain SGD and AdamW on
tests/support/zero_oracle.py's model (uneven sizes, a 1-element parameter): the parameters are
bitwise equal. Both average the grads with the host backend's reduce-scatter (a sum of the two
ranks' grads, then a division: the same order), and torch's optimizer steps the same elements
(ZeRO-2 on 1-D fp32 views of its shards, ours on the DTensor shards). At more ranks the two cut
the grads differently (ZeRO-2's shards cut flat buckets, ours each parameter's rows), so the
sum order, and the last bits, may differ."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from fsdp_cases import full_params, gloo  # noqa: E402
from mp import run_ranks  # noqa: E402
from zero_oracle import OPTIMIZERS, global_batches, local, make_model  # noqa: E402

STEPS = 6
PLAIN = {"sgd": ("SGD", {"lr": 0.05}), "adamw": OPTIMIZERS["adamw"]}


def _steps(model, opt, wrapped, rank: int, world: int) -> None:
    data = global_batches(STEPS)
    for step in range(STEPS):
        x, y = local(data[step], rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()


def _both(rank: int, world: int, store_dir: str) -> dict:
    import nccl_ddp as nd

    out = {}
    with gloo(rank, world, store_dir):
        for name, (cls_name, kw) in PLAIN.items():
            cls = getattr(torch.optim, cls_name)
            m = make_model()
            for sub in (m.a, m.b, m.c, m):
                nd.fully_shard(sub)
            _steps(m, cls(m.parameters(), **kw), m, rank, world)
            zero3 = full_params(m)
            m = make_model()
            ddp = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
            _steps(m, nd.ZeroRedundancyOptimizer(m.parameters(), cls, **kw), ddp, rank, world)
            zero2 = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
            ddp.close()
            out[name] = (zero3, zero2)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fully_shard_params_bitwise_equal_our_zero2(tmp_path):
    for rank, res in enumerate(run_ranks(_both, 2, str(tmp_path), timeout=300)):
        for name, (zero3, zero2) in res.items():
            assert sorted(zero3) == sorted(zero2)
            for k, v in zero2.items():
                np.testing.assert_array_equal(zero3[k], v, err_msg=f"rank {rank} {name} {k}")
