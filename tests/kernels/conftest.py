"""The kernel tests' shared fixture: `cp`, the fake CuPy whose "GPU" runs the CPU build of the real
kernels (tests/support/kernel_checks.py)."""

from kernel_checks import cp  # noqa: F401
