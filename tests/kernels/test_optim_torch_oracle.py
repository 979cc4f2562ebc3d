"""The NumPy references of the fused optimizers (nccl_ddp.ShardSGD/ShardAdamW on NumPy arrays,
i.e. nccl_ddp.kernels.optim_spec) against torch.optim.SGD/AdamW on float32, several steps: SGD
bitwise; AdamW's states bitwise and its parameters bitwise too once torch's CPU sqrt (MKL's, not
correctly rounded) is replaced by an IEEE one."""

import numpy as np
import pytest

import nccl_ddp as nd

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # torch.optim's first step imports torch._dynamo (10-20 s here)


# ---------------------------------------------------------------------------------------------
# the references against torch.optim on float32


SGD_SETTINGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
]


@pytest.mark.parametrize("kw", SGD_SETTINGS, ids=str)
def test_shard_sgd_equals_torch_sgd_bitwise(kw):
    for n in (1, 7, 33, 4099):
        rng = np.random.default_rng(n)
        p0 = rng.standard_normal(n).astype(np.float32)
        tp = torch.nn.Parameter(torch.tensor(p0))
        topt = torch.optim.SGD([tp], foreach=False, **kw)
        opt = nd.ShardSGD(**kw)
        master = p0.copy()
        state = opt.init_state(master)
        for _ in range(6):
            g = rng.standard_normal(n).astype(np.float32)
            tp.grad = torch.tensor(g)
            topt.step()
            opt.step(master, g, state)
        np.testing.assert_array_equal(master.view(np.uint32), tp.detach().numpy().view(np.uint32))
        if kw.get("momentum"):
            buf = topt.state[tp]["momentum_buffer"].numpy()
            np.testing.assert_array_equal(state.buffers["momentum_buffer"], buf)


def _adamw_pair(n, kw, steps=6, clip=None):
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(np.float32)
    tp = torch.nn.Parameter(torch.tensor(p0))
    topt = torch.optim.AdamW([tp], foreach=False, **kw)
    opt = nd.ShardAdamW(**kw)
    master = p0.copy()
    state = opt.init_state(master)
    for t in range(steps):
        g = (rng.standard_normal(n) * (1.0 if t % 2 else 1e-3)).astype(np.float32)
        tp.grad = torch.tensor(g)
        if clip is not None:
            tp.grad.mul_(torch.tensor(clip, dtype=torch.float32))  # clip_grad_norm_'s multiply
        topt.step()
        opt.step(master, g, state, grad_scale=1.0 if clip is None else clip)
    return master, state, tp.detach().numpy(), topt.state[tp]


ADAMW_SETTINGS = [
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-3, amsgrad=True),
    dict(lr=3e-3, betas=(0.3, 0.9), eps=1e-6, weight_decay=0.0),
]


@pytest.mark.parametrize("kw", ADAMW_SETTINGS, ids=str)
def test_shard_adamw_matches_torch_adamw(kw):
    """States bitwise; parameters to 1e-6 (torch's CPU sqrt is MKL's, off by an ulp at times)."""
    for n in (1, 7, 4099, 20000):
        master, state, tparam, tstate = _adamw_pair(n, kw, clip=0.37 if n == 7 else None)
        for name in state.buffers:
            np.testing.assert_array_equal(state.buffers[name], tstate[name].numpy(), name)
        assert state.step == int(tstate["step"]) == 6
        np.testing.assert_allclose(master, tparam, rtol=1e-6, atol=1e-7)


def test_shard_adamw_equals_torch_adamw_bitwise_with_an_ieee_sqrt(monkeypatch):
    """The only difference is torch's CPU sqrt: with Tensor.sqrt correctly rounded (as the GPU's
    sqrt.rn and NumPy's), every parameter is bitwise equal."""
    ieee = lambda self: torch.from_numpy(np.sqrt(self.detach().numpy()))  # noqa: E731
    master, _, tparam, _ = _adamw_pair(20000, ADAMW_SETTINGS[0])
    assert (master != tparam).any()  # torch's own sqrt: some ulps apart
    monkeypatch.setattr(torch.Tensor, "sqrt", ieee)
    for kw in ADAMW_SETTINGS:
        master, _, tparam, _ = _adamw_pair(20000, kw)
        np.testing.assert_array_equal(master.view(np.uint32), tparam.view(np.uint32))
