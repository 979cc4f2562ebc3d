"""Argument checks shared by every layer: each failure is a `ConfigTypeError` (a TypeError) or a
`ConfigError` (a ValueError) that names the argument and the value it got."""

from __future__ import annotations

from typing import Any

import numpy as np

from nccl_ddp.errors import ConfigError, ConfigTypeError


def check_bool(name: str, value: Any) -> None:
    """bool only: 0/1, None and strings are refused so a misplaced argument is caught."""
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_positive_int(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """A real int (bool is refused: `True` is not a count) that is > 0 (or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_float_dtype(label: str, dtype: Any) -> None:
    """Grads are reduced as floating point (float16/32/64, bfloat16): refuse the rest up front."""
    name = getattr(dtype, "name", str(dtype))
    floating = isinstance(dtype, np.dtype) and np.issubdtype(dtype, np.floating)
    if name != "bfloat16" and not floating:
        raise ConfigTypeError(
            f"{label} has dtype {name}; only floating point parameters (float16, "
            "float32, float64, bfloat16) can be reduced: leave integer, complex and "
            "other buffers out"
        )


def check_mib(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """A size in MiB (bucket_cap_mb, broadcast_chunk_mb): an int or float, finite and > 0 (or
    >= 0 where 0 means "one parameter per bucket"). NaN, inf and negatives are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(
            f"{name} must be a number of MiB (int or float), got {type(value).__name__} {value!r}"
        )
    if not 0 <= value < float("inf") or (value == 0 and not allow_zero):
        raise ConfigError(
            f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'} MiB, got {value}"
        )
