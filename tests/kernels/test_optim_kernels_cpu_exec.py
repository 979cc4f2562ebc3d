"""The real kernels/optim.cu executed on the CPU (tests/support/cuda_cpu: software PTX, warps as fibers,
memory and race checks) through the project's launch path on the fake CuPy: every nd_sgd/nd_adamw
instantiation bit for bit against the NumPy references (nccl_ddp.kernels.optim_spec), on random
shards of any length and alignment with subnormals, -0.0, huge values and NaN/Inf grads."""

import _fake_cupy
import numpy as np
import pytest
from kernel_cases import DT, SCALES, values
from kernel_checks import assert_bits_equal

from nccl_ddp import kernels as K
from nccl_ddp.errors import KernelError
from nccl_ddp.kernels import cuda as ck
from nccl_ddp.kernels import cuda_optim
from nccl_ddp.kernels.optim_spec import GRAD_DTYPES, PARAM_DTYPES

PAIRS = [(g, p) for g in sorted(GRAD_DTYPES) for p in sorted(PARAM_DTYPES)]
LENGTHS = [1, 2, 3, 4, 5, 7, 31, 64, 129, 1000, 3001]


def _state(rng, n, nonneg=False):
    x = values(rng, n, "float32")
    x[np.isnan(x) | np.isinf(x)] = 1.0
    return np.abs(x) if nonneg else x


def _shard(cp, rng, n, gt, pt, names, out, same_offset):
    """Host arrays and their fake-device copies. same_offset: every array starts the same number
    of elements past a 16-byte boundary (the vector path after a scalar head); else each has its
    own offset (all scalar)."""
    e = int(rng.integers(0, 4))
    host = {"master": values(rng, n, "float32"), "grad": values(rng, n, gt, nonfinite=True)}
    for name in names:
        host[name] = _state(rng, n, nonneg=name != "exp_avg")
    if out:
        host["out"] = np.full(n, np.nan, DT[pt])
    dev = {}
    for k, h in host.items():
        off = e if same_offset else int(rng.integers(0, 4))
        dev[k] = cp.asarray(h, misalign=off * h.dtype.itemsize)
    return host, dev


def _sgd_kwargs(rng):
    momentum = float(rng.choice([0.0, 0.9, 0.5]))
    nesterov = bool(momentum and rng.integers(0, 2))
    return dict(
        lr=float(rng.choice([0.1, 1e-3, 3.0])),
        momentum=momentum,
        dampening=0.0 if nesterov else float(rng.choice([0.0, 0.1])),
        weight_decay=float(rng.choice([0.0, 1e-2])),
        nesterov=nesterov,
        fresh_buffer=bool(rng.integers(0, 2)),
        grad_scale=float(rng.choice(SCALES)),
    )


def _adamw_kwargs(rng):
    return dict(
        step=int(rng.choice([1, 2, 7, 1000])),
        lr=float(rng.choice([1e-3, 0.1])),
        beta1=float(rng.choice([0.9, 0.3, 0.0])),
        beta2=float(rng.choice([0.999, 0.95])),
        eps=float(rng.choice([1e-8, 1e-40])),
        weight_decay=float(rng.choice([0.0, 0.1])),
        amsgrad=bool(rng.integers(0, 2)),
        grad_scale=float(rng.choice(SCALES)),
    )


def _run(cp, rng, op, gt, pt, n, same_offset, out=True):
    if op == "sgd":
        kw = _sgd_kwargs(rng)
        names = ["buf"] if kw["momentum"] else []
    else:
        kw = _adamw_kwargs(rng)
        names = ["exp_avg", "exp_avg_sq"] + (["vmax"] if kw["amsgrad"] else [])
    host, dev = _shard(cp, rng, n, gt, pt, names, out, same_offset)

    def call(a):
        if op == "sgd":
            K.sgd_step(a["master"], a["grad"], a.get("buf"), a.get("out"), **kw)
        else:
            K.adamw_step(
                a["master"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a.get("vmax"), a.get("out"), **kw
            )

    before = len(cp.launches)
    call(dev)
    call(host)
    assert len(cp.launches) == before + 1
    assert cp.launches[-1][0] == ck.optim_kernel_name(op, gt, pt if out else "float32")
    for k, h in host.items():
        if k != "grad":
            assert_bits_equal(dev[k].host(), h, f"{op} {gt}->{pt} n={n} {k} {kw}")
    assert_bits_equal(dev["grad"].host(), host["grad"], "grad is read only")


@pytest.mark.parametrize("op", ["sgd", "adamw"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_fused_step_bit_exact_any_length_and_alignment(cp, op, pair):
    rng = np.random.default_rng([len(op), *map(len, pair)])
    for i, n in enumerate(LENGTHS):
        _run(cp, rng, op, *pair, n, same_offset=i % 2 == 0)
    _run(cp, rng, op, *pair, 77, same_offset=True, out=False)


@pytest.mark.parametrize("op", ["sgd", "adamw"])
def test_one_block_strides_over_a_long_shard(cp, monkeypatch, op):
    """One block of 256 threads for 9,000 elements: every thread's grid-stride loop runs."""
    monkeypatch.setitem(_fake_cupy.FAKE_STATE, "sms", 1)
    monkeypatch.setattr(cuda_optim, "BLOCKS_PER_SM", 1)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    rng = np.random.default_rng(5)
    _run(cp, rng, op, "bfloat16", "bfloat16", 9001, same_offset=True)
    assert cp.launches[-1][1] == 1
    _run(cp, rng, op, "float32", "float16", 9001, same_offset=False)


def test_subnormals_and_signed_zeros_survive_cupys_ftz(cp):
    """CuPy compiles with -ftz=true: the float32 updates must keep subnormal grads, states and
    results (inline PTX without .ftz), and -0.0 where torch keeps it."""
    tiny = np.array([2.0**-149, -(2.0**-140), 1e-39, -1e-40, -0.0, 0.0, 1e-30, 3e-38] * 5, np.float32)
    n = tiny.size
    for op in ("sgd", "adamw"):
        host = {
            "master": tiny[::-1].copy(),
            "grad": tiny.copy(),
            "a": np.abs(tiny),
            "b": np.abs(tiny[::-1]),
            "out": np.zeros(n, np.float32),
        }
        dev = {k: cp.asarray(v) for k, v in host.items()}
        for a in (dev, host):
            if op == "sgd":
                K.sgd_step(a["master"], a["grad"], a["a"], a["out"], lr=0.5, momentum=0.5, weight_decay=0.25)
            else:
                K.adamw_step(
                    a["master"],
                    a["grad"],
                    a["a"],
                    a["b"],
                    None,
                    a["out"],
                    step=3,
                    lr=1e-38,
                    eps=1e-45,
                    weight_decay=0.0,
                )
        for k in host:
            assert_bits_equal(dev[k].host(), host[k], f"{op} {k}")
        u = host["out"].view(np.uint32)
        assert np.count_nonzero(((u & 0x7F800000) == 0) & ((u & 0x7FFFFFFF) != 0)) >= 5, op


def test_bad_shards_are_refused_before_any_write(cp):
    n = 64
    m, g = cp.asarray(np.ones(n, np.float32)), cp.asarray(np.ones(n, np.float32))
    a, v = cp.asarray(np.zeros(n, np.float32)), cp.asarray(np.zeros(n, np.float32))
    cases = [
        ((m, g, a, a), "exp_avg and exp_avg_sq share memory"),
        ((m, m, a, v), "(master and grad|grad and master) share memory"),
        ((m, g[: n - 1], a, v), "grad has 63 elements but master has 64"),
        ((m, cp.asarray(np.ones(n, np.float64)), a, v), "grad dtype float64"),
        ((cp.asarray(np.ones(n, np.float16)), g, a, v), "master is float16"),
        (
            (m, cp.asarray(np.ones(n + 1, np.float32)).view(np.uint8)[2 : 2 + 4 * n].view(np.float32), a, v),
            "not a multiple of its 4-byte",
        ),
    ]
    for args, message in cases:
        with pytest.raises(KernelError, match=message):
            K.adamw_step(*args, None, None, step=1, lr=0.1)
    with pytest.raises(KernelError, match="needs a momentum_buf"):
        K.sgd_step(m, g, None, None, lr=0.1, momentum=0.9)
    with pytest.raises(KernelError, match="same device"):
        K.sgd_step(m, np.ones(n, np.float32), None, None, lr=0.1)
    assert cp.launches == []
    assert (m.host() == 1).all() and (a.host() == 0).all()
