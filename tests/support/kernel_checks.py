"""Helpers of the kernel tests (tests/kernels): the `cp` fixture (the fake CuPy whose "GPU" runs
the CPU build of the real kernels, tests/support/cuda_cpu), a bitwise comparison that names the
first differing elements, and NVRTC or a skip."""

import sys

import _fake_cupy
import numpy as np
import pytest
from _fake_cupy import FakeCupy
from kernel_cases import UINT

from nccl_ddp.kernels import cuda as ck


def cpu_or_skip():
    if _fake_cupy.cpu_kernels() is None:
        pytest.skip(_fake_cupy.CPU_KERNELS_MISSING)


@pytest.fixture
def cp(monkeypatch):
    return fake_cupy_installed(monkeypatch)


def fake_cupy_installed(monkeypatch):
    cpu_or_skip()
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
    return fake


def assert_bits_equal(got, want, what=""):
    """Bit for bit, NaN compared as NaN (payloads are not preserved, see the README)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    assert got.dtype == want.dtype and got.shape == want.shape
    u = UINT[got.dtype.itemsize]
    gb, wb = got.view(u), want.view(u)
    both_nan = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    bad = np.flatnonzero((gb != wb) & ~both_nan)
    if bad.size:
        i = bad[:5]
        pytest.fail(
            f"{what}: {bad.size} of {got.size} elements differ, first at {i.tolist()}: "
            f"got {got[i].tolist()} ({[hex(int(x)) for x in gb[i]]}) want "
            f"{want[i].tolist()} ({[hex(int(x)) for x in wb[i]]})"
        )


def nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # not installed, or the NVRTC library is missing
        pytest.skip(f"NVRTC not usable ({e}); pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")
    return nvrtc
