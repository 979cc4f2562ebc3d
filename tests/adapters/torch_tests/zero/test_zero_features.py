"""ZeRO-2 beside the wrapper's other features (2 ranks, host backend, gloo for torch's side):
no_sync() accumulation and overlap_param_gather (also with a collective of the caller's before
the next forward) and find_unused_parameters train exactly as torch DDP + unsharded AdamW;
a comm hook, static_graph, PythonReducer and Join are refused with a ConfigError naming them
(static_graph and PythonReducer when the model is built with zero=; a comm hook when registered
on such a model)."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from mp import run_ranks  # noqa: E402
from zero_oracle import OPTIMIZERS, STEPS, global_batches, gloo_and_host, local, make_model, train  # noqa: E402

WORLD = 2
SMALL = 400 / (1 << 20)


def _features(rank: int, world: int, store_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    with gloo_and_host(rank, world, store_dir):
        cls, kw = OPTIMIZERS["adamw"]
        adamw = getattr(torch.optim, cls)
        overlap_cfg = nd.ZeroConfig(stage=2, overlap_param_gather=True)
        out: dict = {}
        m = make_model()
        ref_acc = train(m, adamw(m.parameters(), **kw), TorchDDP(m), rank, world, accumulate=2)
        m = make_model()
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=nd.ZeroConfig(stage=2))
        z = nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
        out["no_sync"] = (ref_acc, train(m, z, ddp, rank, world, accumulate=2))
        ddp.close()

        m = make_model()
        ref = train(m, adamw(m.parameters(), **kw), TorchDDP(m), rank, world)
        m = make_model()
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=overlap_cfg)
        z = nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
        ours = train(m, z, ddp, rank, world)
        out["overlap_pending_after_step"] = z.shard_memory.gather_pending
        z.shard_memory.wait_all()
        out["overlap"] = (ref, {n: p.detach().numpy().copy() for n, p in m.named_parameters()})
        ddp.close()
        assert set(ours) == set(ref)

        # overlap, and a collective of the caller's between step() and the next forward while
        # rank 1's comm stream lags: the all-gathers still come first on every rank
        m = make_model()
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=overlap_cfg)
        z = nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
        data = global_batches()
        for step in range(STEPS):
            x, y = local(data[step], rank, world)
            z.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if rank == 1:
                ddp.reducer.comm.submit(time.sleep, 0.3)
            z.step()
            nd.all_reduce(torch.ones(1))
        z.shard_memory.wait_all()
        out["overlap_collective"] = (ref, {n: p.detach().numpy().copy() for n, p in m.named_parameters()})
        ddp.close()

        # find_unused_parameters: gain is unused on odd steps on every rank (its grad stays None,
        # AdamW skips it, weight decay included), on rank 1 also on even steps
        def use_gain(step):
            return step % 2 == 0 and not (rank == 1 and step % 4 == 0)

        results = []
        for ours_side in (False, True):
            m = make_model()
            if ours_side:
                wrapped = nd.DistributedDataParallel(
                    m, bucket_cap_mb=SMALL, find_unused_parameters=True, zero=nd.ZeroConfig(stage=2)
                )
                opt = nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
            else:
                wrapped = TorchDDP(m, find_unused_parameters=True)
                opt = adamw(m.parameters(), **kw)
            for step in range(STEPS):
                x, y = local(data[step], rank, world)
                opt.zero_grad()
                h = wrapped(x, use_gain=use_gain(step))
                torch.nn.functional.mse_loss(h, y).backward()
                opt.step()
            results.append({n: p.detach().numpy().copy() for n, p in m.named_parameters()})
            if ours_side:
                wrapped.close()
        out["find_unused"] = tuple(results)

        refusals = {}
        for name, kwargs in (
            ("static_graph", dict(static_graph=True)),
            ("PythonReducer", dict(reducer_mode="PythonReducer")),
        ):
            try:  # refused when the model is built: sharding is chosen then
                nd.DistributedDataParallel(make_model(), zero=nd.ZeroConfig(stage=2), **kwargs)
            except ConfigError as e:
                refusals[name] = str(e)
        m = make_model()  # (a hook registered before cannot be: sharding is chosen at build)
        ddp = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
        nd.ZeroRedundancyOptimizer(m.parameters(), adamw, zero_stage=2, **kw)
        try:
            ddp.register_comm_hook(None, nd.hooks.bf16_compress)
        except ConfigError as e:
            refusals["hook_after"] = str(e)
        try:
            ddp.reducer.shadow_step()
        except ConfigError as e:
            refusals["join"] = str(e)
        ddp.close()
        out["refusals"] = refusals
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_features, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=170)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no_sync", "overlap", "overlap_collective", "find_unused"])
def test_matches_torch_ddp_with_unsharded_adamw(results, case):
    for rank, res in enumerate(results):
        reference, ours = res[case]
        for key in reference:
            np.testing.assert_allclose(
                ours[key], reference[key], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {case}: {key}"
            )


@pytest.mark.slow
def test_overlap_leaves_the_gather_to_the_next_forward(results):
    assert all(res["overlap_pending_after_step"] for res in results)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, match",
    [
        ("static_graph", "static_graph=True drops parameters"),
        ("PythonReducer", "reducer_mode='PythonReducer'"),
        ("hook_after", "comm hook 'bf16_compress_hook'"),
        ("join", "Join with a sharded optimizer"),
    ],
)
def test_conflicts_are_refused_naming_them(results, name, match):
    for rank, res in enumerate(results):
        assert name in res["refusals"], f"rank {rank}: {name} was not refused"
        assert match in res["refusals"][name]
        assert f"rank {rank}" in res["refusals"][name]
