"""nd.ZeroRedundancyOptimizer on one rank, in this process: what it cannot shard is refused with a
ConfigError naming it and a refused call changes nothing; add_param_group keeps the state; a bf16
model's fp32 masters travel in the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from zero_oracle import host_alone, make_model  # noqa: E402

import nccl_ddp as nd  # noqa: E402
from nccl_ddp.errors import ConfigError, ConfigTypeError  # noqa: E402

# the first torch optimizer built in a process imports torch._dynamo (5-7 s here)
pytestmark = pytest.mark.slow


@pytest.fixture
def world1(monkeypatch):
    with host_alone(monkeypatch):
        yield


def _step(model, opt, scale=1.0):
    opt.zero_grad()
    (model(torch.ones(2, 7)).square().sum() * scale).backward()
    opt.step()


def _local_state(opt):
    return {
        k: {n: v.clone() for n, v in s.items()}
        for k, s in ((id(t), opt._inner.state[t]) for t in opt._piece_params if t in opt._inner.state)
    }


def test_non_elementwise_optimizer_is_refused(world1):
    m = make_model()
    with pytest.raises(
        ConfigError,
        match=r"torch\.optim\.lbfgs\.LBFGS is not known to be "
        r"elementwise",
    ):
        nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.LBFGS, lr=0.1)
    with pytest.raises(ConfigTypeError, match="optimizer_class must be"):
        nd.ZeroRedundancyOptimizer(m.parameters(), "AdamW", lr=0.1)
    # refused before anything moved: the parameters are still the module's own storage
    assert all(p._base is None for p in m.parameters())


def test_registered_elementwise_class_is_accepted(world1):
    from nccl_ddp.adapters.torch.zero.optimizer import register_elementwise

    @register_elementwise
    class MySGD(torch.optim.SGD):
        pass

    m = make_model()
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), MySGD, lr=0.1)
    before = m.a.weight.detach().clone()
    _step(m, opt)
    assert not torch.equal(before, m.a.weight)


def test_params_not_covered_by_the_wrapper(world1):
    m = make_model()
    ddp = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="do not belong to the sharded model"):
        nd.ZeroRedundancyOptimizer([*m.parameters(), extra], torch.optim.AdamW, lr=0.1, zero_stage=2)
    with pytest.raises(ConfigError, match=r"missing \['gain'\]"):
        nd.ZeroRedundancyOptimizer(list(m.parameters())[1:], torch.optim.AdamW, lr=0.1, zero_stage=2)
    with pytest.raises(ConfigError, match=r"zero_stage=2 needs the parameters of a model built for ZeRO-2"):
        nd.ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.AdamW, lr=0.1, zero_stage=2)
    ddp.close()


def test_incompatible_checkpoint_changes_nothing(world1):
    m = make_model()
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01)
    _step(m, opt)
    before = _local_state(opt)
    other = torch.nn.Sequential(
        torch.nn.Linear(7, 13),
        torch.nn.Linear(13, 4),
        torch.nn.Linear(4, 3),
        torch.nn.Linear(1, 1, bias=False),
    )
    torch_opt = torch.optim.AdamW(other.parameters(), lr=0.01)
    sum(p.sum() for p in other.parameters()).backward()
    torch_opt.step()
    sd = torch_opt.state_dict()
    with pytest.raises(
        ConfigError,
        match=r"state 'exp_avg' of parameter 0 \(shape \(1,\)\) has shape "
        r"\(13, 7\).* another model",
    ):
        opt.load_state_dict(sd)
    after = _local_state(opt)
    assert before.keys() == after.keys()
    for k in before:
        for n in before[k]:
            assert torch.equal(before[k][n], after[k][n]), n
    with pytest.raises(ConfigError, match="param groups of sizes"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    with pytest.raises(ConfigError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"params": []})


def test_state_dict_needs_consolidation(world1):
    m = make_model()
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01)
    with pytest.raises(ConfigError, match=r"consolidate_state_dict\(to=this rank\)"):
        opt.state_dict()
    with pytest.raises(ConfigError, match="not a rank of the group"):
        opt.consolidate_state_dict(to=1)


def test_non_finite_grads_skip_the_step(world1):
    m = make_model()
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01)
    _step(m, opt)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    _step(m, opt, scale=float("nan"))
    assert opt.last_step_skipped
    for n, p in m.named_parameters():
        assert torch.equal(before[n], p), n
    _step(m, opt)
    assert not opt.last_step_skipped
    assert not torch.equal(before["a.weight"], m.a.weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(overlap_with_ddp=True), "overlap_with_ddp=True"),
        (dict(zero_stage=3), "zero_stage must be"),
        (dict(overlap_param_gather=True), "overlap_param_gather=True needs ZeRO-2"),
        (dict(reduce_dtype=torch.float16), "reduce_dtype must be None"),
        (dict(reduce_dtype="bfloat16"), "reduce_dtype must be None"),
        (dict(reduce_dtype="float32"), "reduce_dtype=float32 needs ZeRO-2"),
    ],
)
def test_options_we_cannot_honour(world1, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        nd.ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.AdamW, lr=0.1, **kwargs)


def test_clip_reports_the_global_norm(world1):
    m = make_model()
    ref = make_model()
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    for model in (m, ref):
        model(torch.ones(2, 7)).square().sum().backward()
    norm = opt.clip_grad_norm_(0.5)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    np.testing.assert_allclose(float(norm), float(expected), rtol=1e-6)
    with pytest.raises(ConfigError, match="norm_type=2 only"):
        opt.clip_grad_norm_(1.0, norm_type=1)


def test_add_param_group_after_steps_keeps_state(world1):
    """ZeRO-1: a group added after two steps re-cuts the shards and keeps every state; the
    next steps equal torch's AdamW given the same group at the same time."""
    ours, ref = make_model(), make_model()
    opts = []
    for m, cls in ((ours, nd.ZeroRedundancyOptimizer), (ref, None)):
        first = [m.a.weight, m.a.bias]
        rest = [p for p in m.parameters() if all(p is not q for q in first)]
        opt = cls(first, torch.optim.AdamW, lr=0.01) if cls else torch.optim.AdamW(first, lr=0.01)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": rest, "lr": 0.03})
            _step(m, opt)
        opts.append(opt)
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
    assert opts[0].param_groups[1]["lr"] == 0.03


def test_bf16_masters_round_trip_through_the_checkpoint(world1):
    m = make_model(torch.bfloat16)
    ddp = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01, zero_stage=2)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.ones(2, 7, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
    opt.consolidate_state_dict(0)
    sd = opt.state_dict()
    masters = sd["fp32_master"]
    for i, p in enumerate(m.parameters()):
        assert masters[i].dtype == torch.float32 and masters[i].shape == p.shape
        assert torch.equal(masters[i].to(torch.bfloat16), p.detach())  # p = rounded master
    # the masters hold what bf16 cannot: a fresh optimizer loads them, not the rounded params
    assert any(not torch.equal(masters[i], p.detach().float()) for i, p in enumerate(m.parameters()))
    ddp.close()
    m2 = make_model(torch.bfloat16)
    m2.load_state_dict(m.state_dict())
    ddp2 = nd.DistributedDataParallel(m2, zero=nd.ZeroConfig(stage=2))
    opt2 = nd.ZeroRedundancyOptimizer(m2.parameters(), torch.optim.AdamW, lr=0.01, zero_stage=2)
    opt2.load_state_dict(sd)
    opt2.consolidate_state_dict(0)
    again = opt2.state_dict()
    for i in masters:
        assert torch.equal(again["fp32_master"][i], masters[i])
        for key, v in sd["state"][i].items():
            assert torch.equal(again["state"][i][key], v), key
    ddp2.close()


def test_reduce_scatter_is_on_the_step_timeline(world1):
    """The timeline counts ZeRO-2's reduce-scatters as the step's communication, one per
    bucket (before: comm 0 ms, 0 buckets)."""
    from nccl_ddp.profiling import Timeline

    m = make_model()
    ddp = nd.DistributedDataParallel(m, bucket_cap_mb=400 / (1 << 20), zero=nd.ZeroConfig(stage=2))
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, zero_stage=2)
    ddp.reducer.prof = Timeline(0, timeline=True)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.ones(2, 7)).square().sum().backward()
        opt.step()
    last = ddp.reducer.prof.steps[-1]
    assert last.comm_s > 0
    assert last.buckets == len(ddp.reducer.layout.buckets) > 1
    ddp.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_param_gather_is_on_the_step_timeline(world1, overlap):
    """Each bucket's parameter all-gather is an "allgather" span in the next step (beside that
    step's forward), and the share hidden behind forward is measured from those spans: without
    overlap_param_gather, step() waits for the gathers, so none is hidden; with it, forward
    starts while the gathers are still queued (held back here by a task on the comm stream),
    and its modules wait for them inside forward."""
    import time

    from nccl_ddp.profiling import Timeline

    m = make_model()
    zero = nd.ZeroConfig(stage=2, overlap_param_gather=overlap)
    ddp = nd.DistributedDataParallel(m, bucket_cap_mb=400 / (1 << 20), zero=zero)
    opt = nd.ZeroRedundancyOptimizer(
        m.parameters(), torch.optim.SGD, lr=0.1, zero_stage=2, skip_nonfinite=False
    )  # (the non-finite check's norm would wait for the comm stream inside step())
    ddp.reducer.prof = Timeline(0, timeline=True)
    nbuckets = len(opt.shard_memory.layout.buckets)
    assert nbuckets > 1
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.ones(2, 7)).square().sum().backward()
        opt.shard_memory.comm.submit(time.sleep, 0.3)  # the gathers start 0.3 s after step() returns
        opt.step()
    steps = list(ddp.reducer.prof.steps)
    assert steps[0].gather_s == 0 and steps[0].forward_s > 0  # no optimizer step before it
    for st in steps[1:]:
        gathers = [s for s in ddp.reducer.prof.spans if s.step == st.step and s.phase == "allgather"]
        assert sorted(s.bucket for s in gathers) == list(range(nbuckets))
        assert st.gather_s > 0 and st.forward_s > 0
        if overlap:
            assert st.gather_hidden_ratio > 0.5, st.line()
        else:
            assert (st.gather_hidden_s, st.gather_hidden_ratio) == (0.0, 0.0), st.line()
    ddp.close()


def test_check_finite_flags_reach_through_the_reduce_scatter(world1):
    """ZeRO-2 keeps the wrapper's check_finite: the pack kernel raises the bucket's flag on the
    way into the reduce-scatter, and the optimizer skips the step."""
    m = make_model()
    ddp = nd.DistributedDataParallel(m, check_finite=True, zero=nd.ZeroConfig(stage=2))
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=0.01, zero_stage=2)
    for scale, finite in ((1.0, True), (float("inf"), False), (1.0, True)):
        before = m.a.weight.detach().clone()
        opt.zero_grad()
        (ddp(torch.ones(2, 7)).square().sum() * scale).backward()
        opt.step()
        assert ddp.last_step_finite is finite
        assert opt.last_step_skipped is not finite
        assert torch.equal(before, m.a.weight) is not finite
    ddp.close()


def test_zero2_grads_refuse_to_be_read_as_averaged(world1):
    """Under ZeRO-2, p.grad after backward is this rank's local grad: torch's
    clip_grad_norm_ or arithmetic on it raises ShardedGradError naming opt.clip_grad_norm_
    (before: it silently clipped local values); metadata reads and zero_grad(set_to_none=False)
    still work, and training with the latter equals torch's SGD on the same model."""
    from nccl_ddp.adapters.torch.zero.guarded_grads import LocalGrad
    from nccl_ddp.errors import ShardedGradError

    ours, ref = make_model(), make_model()
    ddp = nd.DistributedDataParallel(ours, zero=nd.ZeroConfig(stage=2))
    opt = nd.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for model, o in ((ddp, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            model(torch.ones(2, 7) * (step + 1)).square().sum().backward()
        g = ours.a.weight.grad
        assert isinstance(g, LocalGrad) and g.shape == ours.a.weight.shape and g.dtype == torch.float32
        with pytest.raises(ShardedGradError, match=r"rank 0: .*opt\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        with pytest.raises(ShardedGradError, match="local"):
            g.sum()
        opt.step()
        ref_opt.step()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
    ddp.close()


def test_zero2_module_moves_keep_the_grads_guarded(world1):
    """module.cpu() / .to() / .double() apply to the grads too (Lightning's teardown calls
    .cpu()): they work under ZeRO-2 and the moved grads stay guarded."""
    from nccl_ddp.adapters.torch.zero.guarded_grads import LocalGrad

    m = make_model()
    ddp = nd.DistributedDataParallel(m, zero=nd.ZeroConfig(stage=2))
    opt = nd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    opt.zero_grad()
    ddp(torch.ones(2, 7)).square().sum().backward()
    m.cpu()
    m.to(torch.float32)
    assert isinstance(m.a.weight.grad, LocalGrad)
    m.double()
    assert isinstance(m.a.weight.grad, LocalGrad) and m.a.weight.grad.dtype == torch.float64
    ddp.close()


def test_model_moved_after_the_optimizer_is_built_still_trains(world1):
    """accelerate's and HF's prepare call model.to(device) after the optimizer is built, and
    .to("cpu:0") gives every parameter new storage: the step copies them back into its flat
    buffers and re-points them (before: the optimizer updated buffers the model no longer read,
    silently); the result equals torch's SGD. A cast is refused naming the parameter."""
    ours, ref = make_model(), make_model()
    opt = nd.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ours.to(torch.device("cpu:0"))
    for _ in range(3):
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            model(torch.ones(2, 7)).square().sum().backward()
            o.step()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
    ours.double()
    with pytest.raises(ConfigError, match=r"became torch.float64 .* move or cast the model first"):
        opt.step()
