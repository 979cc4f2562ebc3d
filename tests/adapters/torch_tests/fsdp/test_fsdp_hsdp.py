"""HSDP: `nccl_ddp.fully_shard(mesh=init_device_mesh("cpu", (2, 2)))` replicates on the mesh's
dim 0 and shards on dim 1, as FSDP2's 2-D mesh: the reduce-scattered shard is all-reduced over
the replicate group too. Held to torch's own fully_shard on the same mesh over gloo at 4 ranks
(torch's test_train_parity_hsdp, without its GPU-only parts): 20 steps of torch's test
Transformer, losses and trained parameters to 1e-5 (gloo adds in another order). Then gradient
accumulation with `set_requires_all_reduce(False)` on all micro-batches but the last (torch's
partial reductions: reduce-scattered every backward, all-reduced once, the sharded grads untouched
in between), alone and after a `set_requires_gradient_sync(False)` one, held to torch's the same
way."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import full_params, gloo, shard_blocks, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402

STEPS = 20
ACCUM_STEPS = 2


# per micro-batch: (requires_gradient_sync, requires_all_reduce) set before it, in that order
ACCUM = {
    "all_reduce_on_last": [(True, False), (True, True)],
    # no_sync, then a reduce-scatter of the two micro-batches' sum kept partial, then all-reduced
    "with_no_sync_first": [(False, False), (True, False), (True, True)],
}


def _sync(switches: list, seen: list):
    """The `sync` of `train` for one of ACCUM's schedules; before the last micro-batch, whether
    every sharded grad is still None (the earlier ones' shards kept apart)."""
    k = itertools.count()

    def sync(model, last: bool) -> None:
        gradient_sync, all_reduce = switches[next(k) % len(switches)]
        if last:
            seen.append(all(p.grad is None for p in model.parameters()))
        model.set_requires_gradient_sync(gradient_sync)
        model.set_requires_all_reduce(all_reduce)

    return sync


def _hsdp(rank: int, world: int, store_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    with gloo(rank, world, store_dir):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for who, fs in torch_and_ours():
            model = shard_blocks(transformer(2), fs, mesh=mesh)
            res = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens(rank, STEPS))
            res["params"] = full_params(model)
            res["local_rows"] = model.output.weight.to_local().shape[0]
            for name, switches in ACCUM.items():
                model = shard_blocks(transformer(2), fs, mesh=mesh)
                seen: list = []
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                data = tokens(rank, ACCUM_STEPS, micro=len(switches))
                res[name] = train(model, opt, data, sync=_sync(switches, seen))
                res[name].update(params=full_params(model), grads_none_between=seen)
            out[who] = res
    return out


pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_hsdp_2d_mesh_matches_torch(tmp_path):
    ranks = run_ranks(_hsdp, 4, str(tmp_path), timeout=360)
    for rank, (ours, ref) in enumerate((got["ours"], got["torch"]) for got in ranks):
        assert ours["local_rows"] == ref["local_rows"] == 32, rank  # 64 rows over the 2 shards
        for run in [(ours, ref)] + [(ours[a], ref[a]) for a in ACCUM]:
            np.testing.assert_allclose(run[0]["losses"], run[1]["losses"], rtol=1e-5, err_msg=str(rank))
            for name, value in run[1]["params"].items():
                np.testing.assert_allclose(run[0]["params"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        for a in ACCUM:
            between = [ours[a]["grads_none_between"], ref[a]["grads_none_between"]]
            assert between == [[True] * ACCUM_STEPS] * 2, (rank, a)
    # replicas agree: ranks 0 and 2 (and 1 and 3) hold the same shard, all the same full params
    for name in ranks[0]["ours"]["params"]:
        np.testing.assert_array_equal(ranks[0]["ours"]["params"][name], ranks[3]["ours"]["params"][name])
