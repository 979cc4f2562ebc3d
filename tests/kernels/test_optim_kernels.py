"""Fused optimizers on any machine: the NumPy reference's exact fma, the flat-shard optimizers
(nccl_ddp.ShardSGD/ShardAdamW) on NumPy and on the fake CuPy running the real kernels/optim.cu,
their errors, and the PTX NVRTC makes of it. Against torch.optim: test_optim_torch_oracle.py."""

import re

import numpy as np
import pytest
from _fake_cupy import cupy_nvrtc_options
from kernel_checks import nvrtc_or_skip

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, ConfigTypeError, KernelError
from nccl_ddp.kernels import cuda as ck
from nccl_ddp.kernels import optim_spec as S

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------------------------------------
# exact arithmetic of the reference


def _round_f32(q):
    """The float32 nearest the rational q (ties to even), exactly."""
    from fractions import Fraction

    r0 = np.float32(float(q))
    cands = [r0, np.nextafter(r0, np.float32(np.inf)), np.nextafter(r0, np.float32(-np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1))


def test_fma_is_one_rounding():
    """optim_spec.fma against exact rational arithmetic, on cases where a multiply then an add
    rounds differently (cancellation, subnormal results and addends)."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    a = (rng.standard_normal(3000) * 2.0 ** rng.integers(-40, 40, 3000)).astype(np.float32)
    b = (rng.standard_normal(3000) * 2.0 ** rng.integers(-40, 40, 3000)).astype(np.float32)
    c = -(a.astype(np.float64) * b).astype(np.float32)  # cancellation: the error term
    c[::3] = (rng.standard_normal(1000) * 2.0**-140).astype(np.float32)  # subnormals
    a[1::7] = (a[1::7] * np.float32(2.0**-60)).astype(np.float32)  # subnormal results
    got = S.fma(a, b, c)
    for x, y, z, r in zip(a, b, c, got):
        want = _round_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert r.view(np.uint32) == np.array(want).view(np.uint32), (x, y, z, r, want)
    assert (S.fma(a, b, c) != a * b + c).any()  # the test sees a difference at all
    sp = np.array([0.0, -0.0, np.inf, np.nan, 1.0], np.float32)
    assert np.signbit(S.fma(sp[1:2], sp[4:5], sp[1:2]))[0]  # -0 * 1 + -0 = -0
    assert np.isnan(S.fma(sp[2:3], sp[0:1], sp[4:5]))[0]  # inf * 0 = NaN
    assert S.fma(sp[2:3], sp[4:5], sp[4:5])[0] == np.inf


# ---------------------------------------------------------------------------------------------
# the shard optimizers: low-precision copies, state, errors


def test_params_out_is_the_new_master_cast_and_no_copy_is_made_without_it():
    rng = np.random.default_rng(3)
    master = rng.standard_normal(1000).astype(np.float32)
    out = np.zeros(1000, BF16)
    opt = nd.ShardAdamW(lr=0.1)
    state = opt.init_state(master)
    g = rng.standard_normal(1000).astype(BF16)
    opt.step(master, g, state, params_out=out, grad_scale=0.5)
    np.testing.assert_array_equal(out, master.astype(BF16))
    assert sorted(state.buffers) == ["exp_avg", "exp_avg_sq"] and state.step == 1
    before = master.copy()
    opt.step(master, g, state)
    assert (master != before).all()


@pytest.mark.parametrize(
    "make, message, error",
    [
        (lambda: nd.ShardSGD(lr=-0.1), "lr must be finite and >= 0", ConfigError),
        (lambda: nd.ShardSGD(lr=0.1, nesterov=True), "nesterov=True needs momentum > 0", ConfigError),
        (lambda: nd.ShardSGD(lr="0.1"), "lr must be a number", ConfigTypeError),
        (
            lambda: nd.ShardAdamW(betas=(0.9, 1.0)),
            r"betas\[1\] must be finite and in \[0.0, 1.0\)",
            ConfigError,
        ),
        (lambda: nd.ShardAdamW(betas=0.9), "betas must be a pair", ConfigTypeError),
        (lambda: nd.ShardAdamW(eps=float("nan")), "eps must be finite", ConfigError),
        (lambda: nd.ShardAdamW(amsgrad=1), "amsgrad", ConfigTypeError),
    ],
)
def test_bad_settings_are_refused(make, message, error):
    with pytest.raises(error, match=message):
        make()


def test_bad_steps_are_refused_without_a_partial_update():
    master = np.ones(16, np.float32)
    adam = nd.ShardAdamW(lr=0.1, amsgrad=True)
    state = adam.init_state(master)
    with pytest.raises(ConfigError, match="no \\['max_exp_avg_sq'\\]"):
        adam.step(master, master.copy(), nd.ShardAdamW().init_state(master))
    with pytest.raises(ConfigTypeError, match="state must be the ShardState"):
        adam.step(master, master.copy(), {"exp_avg": master})
    with pytest.raises(KernelError, match="grad has 15 elements but master has 16"):
        adam.step(master, np.ones(15, np.float32), state)
    with pytest.raises(KernelError, match="params_out dtype int32"):
        adam.step(master, master.copy(), state, params_out=np.zeros(16, np.int32))
    with pytest.raises(ConfigError, match="lr must be finite"):
        adam.step(master, master.copy(), state, lr=float("inf"))
    assert (master == 1).all() and state.step == 0
    assert all((b == 0).all() for b in state.buffers.values())


# ---------------------------------------------------------------------------------------------
# the CUDA path on the fake CuPy (the real kernel, executed on the CPU)


@pytest.mark.parametrize(
    "make",
    [lambda: nd.ShardAdamW(lr=1e-2, amsgrad=True), lambda: nd.ShardSGD(lr=0.1, momentum=0.9, nesterov=True)],
)
def test_shard_optimizer_on_cupy_runs_one_launch_per_step_and_equals_numpy(cp, make):
    rng = np.random.default_rng(9)
    n = 2053
    master_h = rng.standard_normal(n).astype(np.float32)
    master_d = cp.asarray(master_h, misalign=4)  # a shard cut at an odd element of a bucket
    out_h, out_d = np.zeros(n, BF16), cp.asarray(np.zeros(n, BF16), misalign=2)
    opt_h, opt_d = make(), make()
    state_h, state_d = opt_h.init_state(master_h), opt_d.init_state(master_d)
    assert all(type(b).__name__ == "FakeArray" for b in state_d.buffers.values())
    for step in range(3):
        g = rng.standard_normal(n).astype(BF16)
        opt_d.step(master_d, cp.asarray(g, misalign=2), state_d, params_out=out_d, grad_scale=0.5)
        opt_h.step(master_h, g, state_h, params_out=out_h, grad_scale=0.5)
        assert len(cp.launches) == step + 1
    assert cp.launches[-1][0].startswith(("nd_adamw<bf16_t, bf16_t>", "nd_sgd<bf16_t, bf16_t>"))
    np.testing.assert_array_equal(master_d.host().view(np.uint32), master_h.view(np.uint32))
    np.testing.assert_array_equal(out_d.host().view(np.uint16), out_h.view(np.uint16))
    for name, b in state_h.buffers.items():
        np.testing.assert_array_equal(state_d.buffers[name].host(), b, name)


# ---------------------------------------------------------------------------------------------
# what NVRTC makes of kernels/optim.cu with CuPy's options


@pytest.mark.slow
def test_fused_kernels_ptx_vectors_no_ftz_no_local_memory():
    nvrtc = nvrtc_or_skip()
    names = [
        ck.optim_kernel_name(op, g, p)
        for op in ("sgd", "adamw")
        for g, p in (("float32", "bfloat16"), ("bfloat16", "float16"))
    ]
    prog = nvrtc.createProgram(ck.module_source(), "optim.cu", [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    opts = [
        o
        for o in cupy_nvrtc_options(ck.COMPILE_OPTIONS, "compute_90", tuple(nvrtc.getVersion()))
        if o != "--pch"
    ]
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:
        pytest.fail(f"NVRTC: {e}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    bodies = re.split(r"\.entry ", ptx)[1:]
    assert len(bodies) == len(names)
    for body in bodies:
        assert re.search(r"ld\.global\.ca\.v4\.u32", body) and re.search(r"st\.global\.wb\.v4\.u32", body), (
            body[:80]
        )  # float32 state vectors
        assert re.search(r"ld\.global\.nc\.(v4\.u32|u64)", body), body[:80]  # 4 grads at once
        assert "fma.rn.f32" in body and ".ftz" not in body and ".local" not in body
        assert re.findall(r"\b(?:ld|st)\.(?:v\d\.)?[usbf]\d+\b", body) == []  # no generic
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
