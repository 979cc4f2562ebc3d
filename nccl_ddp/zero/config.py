"""`ZeroConfig`: the sharding options, validated once and then never changed.

One config for every form: `DistributedDataParallel(module, zero=ZeroConfig(stage=2))` builds the
model's reducer with the reduce-scatter and its shard core at construction; the torch
`ZeroRedundancyOptimizer` over parameters of a model built without it (ZeRO-1), JAX's
`ZeroOptimizer` and the array form build the same core from one (zero/core.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from nccl_ddp.buckets.layout import BucketCaps
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool, check_mib

F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class ZeroConfig(BucketCaps):
    """How parameters, grads and optimizer state are sharded across the ranks."""

    stage: int
    """1: only the optimizer state and the fp32 masters are sharded; the grads are all-reduced
    whole (after backward `p.grad` holds the averaged full grad, torch's contract). 2: the grad
    buckets are reduce-scattered as backward runs and only this rank's shard of the reduced grad
    exists (after backward `p.grad` holds this rank's local grad)."""
    reduce_dtype: Any = None
    """Stage 2: None reduce-scatters each bucket in its own dtype; float32 (`"float32"`,
    `numpy.float32`, `torch.float32`) widens bf16/fp16 buckets and reduces them in fp32."""
    overlap_param_gather: bool = False
    """Stage 2: `step()` returns once the parameter all-gathers are queued; each module's next
    forward waits for its own buckets only."""
    bucket_cap_mb: Optional[float] = None
    """Bucket size cap in MiB of a core the optimizer builds itself (None: 25; finite, > 0). A
    model built with `zero=` keeps its own `bucket_cap_mb`: leave this None there."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2):
            raise ConfigError(f"ZeroConfig: stage must be 1 or 2, got {self.stage!r}")
        check_bool("overlap_param_gather", self.overlap_param_gather)
        if self.bucket_cap_mb is not None:
            check_mib("bucket_cap_mb", self.bucket_cap_mb)
        object.__setattr__(self, "reduce_dtype", reduce_dtype_of(self.reduce_dtype))
        if self.stage == 1 and self.overlap_param_gather:
            raise ConfigError(
                "ZeroConfig: overlap_param_gather=True needs stage=2 (each module's forward waits "
                "for its buckets' all-gather); under stage 1 step() gathers before it returns"
            )
        if self.stage == 1 and self.reduce_dtype is not None:
            raise ConfigError(
                f"ZeroConfig: reduce_dtype={self.reduce_dtype} needs stage=2 (it is the dtype of "
                "the reduce-scatter); under stage 1 the grads arrive all-reduced: drop reduce_dtype"
            )


def reduce_dtype_of(value: Any) -> Optional[np.dtype]:
    """reduce_dtype as NumPy's float32 or None. A framework's float32 (torch.float32) is read by
    its name, so this layer imports no framework."""
    if value is None:
        return None
    name = value
    if type(value).__module__ in ("torch", "jax.numpy", "jax._src.numpy.scalar_types"):
        name = str(value).rpartition(".")[2]
    try:
        ok = not isinstance(name, bool) and np.dtype(name) == F32
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(
            "reduce_dtype must be None (reduce the grads in their own dtype) or float32 "
            f"('float32', numpy.float32, torch.float32), got {value!r}"
        )
    return F32


def check_zero_config(value: Any) -> Optional[ZeroConfig]:
    """The `zero=` argument: None or a ZeroConfig."""
    if value is not None and not isinstance(value, ZeroConfig):
        raise ConfigTypeError(
            "zero must be None or nccl_ddp.ZeroConfig(stage=1 or 2, ...), got "
            f"{type(value).__name__} {value!r}"
        )
    return value
