"""torch's own tools on nd.ZeroRedundancyOptimizer's grads (2 ranks, host backend, gloo for torch's
side): `torch.amp.GradScaler` with SGD (also with an Inf on one rank only, where every rank must
skip the same steps) and `torch.nn.utils.clip_grad_norm_(model.parameters())` (also after
`scaler.unscale_`) give what torch DDP + the unsharded optimizer give, to 1e-6, with the default
(ZeRO-1 over our DDP: the full averaged grads in p.grad) and with ZeRO-2 (our DDP built with
zero=ZeroConfig(stage=2)), or raise an
nccl_ddp error that names what to call instead. Never a silent difference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

import numpy as np  # noqa: E402
from mp import run_ranks  # noqa: E402
from zero_oracle import (  # noqa: E402
    OPTIMIZERS,
    STEPS,
    global_batches,
    gloo_and_host,
    local,
    make_model,
    params_of,
)

WORLD = 2
SMALL = 400 / (1 << 20)  # several buckets, shards cut through parameters
INF_STEP = 3
STAGES = ("default", "zero2")  # zero2: the model built with zero=ZeroConfig(stage=2)
# case -> (optimizer, GradScaler?, clipping, Inf on rank 1 at INF_STEP?); clipping "torch":
# torch.nn.utils.clip_grad_norm_(model.parameters()), "opt": the optimizer's clip_grad_norm_
# (the reference's: torch's)
CASES = {
    "scaler_sgd": ("sgd", True, None, False),
    "scaler_inf_one_rank": ("sgd", True, None, True),
    "torch_clip": ("adamw", False, "torch", False),
    "scaler_unscale_torch_clip": ("adamw", True, "torch", False),
    "scaler_unscale_opt_clip_inf": ("adamw", True, "opt", True),
}


def _loop(model, wrapped, opt, rank: int, world: int, scaler: bool, clip, inf: bool):
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    data = global_batches()
    for step in range(STEPS):
        x, y = local(data[step], rank, world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(wrapped(x), y)
        if inf and step == INF_STEP and rank == 1:
            loss = loss * float("inf")
        (sc.scale(loss) if sc is not None else loss).backward()
        if clip is not None:
            if sc is not None:
                sc.unscale_(opt)
            if clip == "opt" and hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(0.05)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    return params_of(model), None if sc is None else sc.get_scale()


def _run(rank: int, world: int, store_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd
    from nccl_ddp.errors import NcclDdpError

    out: dict = {}
    with gloo_and_host(rank, world, store_dir):
        for case, (name, scaler, clip, inf) in CASES.items():
            cls_name, kw = OPTIMIZERS[name]
            cls = getattr(torch.optim, cls_name)
            m = make_model()
            ref = _loop(m, TorchDDP(m), cls(m.parameters(), **kw), rank, world, scaler, clip, inf)
            for stage in STAGES:
                m = make_model()
                zero = nd.ZeroConfig(stage=2) if stage == "zero2" else None
                ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL, zero=zero)
                z = nd.ZeroRedundancyOptimizer(m.parameters(), cls, **kw)
                try:
                    ours = _loop(m, ddp, z, rank, world, scaler, clip, inf)
                except NcclDdpError as e:
                    ours = e
                out[(case, stage)] = (
                    ref,
                    ours if isinstance(ours, tuple) else (type(ours).__name__, str(ours)),
                )
                ddp.close()
        # uneven inputs: the optimizer is a Joinable, as torch's class (rank 1 runs out early)
        m = make_model()
        ddp = nd.DistributedDataParallel(m, bucket_cap_mb=SMALL)
        z = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.05)
        data = global_batches()
        with nd.Join([ddp, z]):
            for step in range(STEPS if rank == 0 else STEPS - 3):
                x, y = local(data[step], rank, world)
                z.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                z.step()
        out["join"] = (params_of(m), str(z.join_device), z.join_process_group is ddp.process_group)
        ddp.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("gloo")), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_tools_match_torch_ddp_or_raise_naming_the_fix(results, case, stage):
    for rank, res in enumerate(results):
        (ref_params, ref_scale), ours = res[(case, stage)]
        if isinstance(ours[0], str):  # a named error instead of a silent difference
            kind, msg = ours
            assert stage == "zero2" and CASES[case][2] == "torch", f"rank {rank}: {case} raised {kind}: {msg}"
            assert kind == "ShardedGradError" and "opt.clip_grad_norm_" in msg, msg
            continue
        params, scale = ours
        assert scale == ref_scale, (rank, case, stage, scale, ref_scale)
        for key in ref_params:
            np.testing.assert_allclose(
                params[key],
                ref_params[key],
                rtol=1e-6,
                atol=1e-6,
                err_msg=f"rank {rank} {case} {stage}: {key}",
            )
        if CASES[case][1]:  # the Inf step was skipped on every rank: the scale backed off once
            assert ref_scale == (512.0 if CASES[case][3] else 1024.0)


@pytest.mark.slow
def test_optimizer_is_a_joinable_for_uneven_inputs(results):
    """nd.Join([model, opt]) with rank 1 out of data 3 steps early completes (its optimizer
    matches the others' norm all-reduce and parameter all-gathers, as torch's _ZeROJoinHook
    steps); both ranks end with the same trained parameters. Before: Join refused the optimizer
    (not a Joinable)."""
    (p0, dev, group_ok), (p1, _, _) = results[0]["join"], results[1]["join"]
    assert dev == "cpu" and group_ok
    initial = params_of(make_model())
    for key in p0:
        np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)
    assert any(not np.allclose(p0[k], initial[k]) for k in p0)
