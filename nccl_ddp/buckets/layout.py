"""Bucket assignment: which parameters share a flat buffer, at which element offset.

PyTorch DDP's rules (`compute_bucket_assignment_by_size`): buckets are filled in reverse
parameter order (the order backward usually produces grads in), one open bucket per dtype, the
first bucket of each dtype capped at 1 MiB (so the first all-reduce starts early), the rest at
`bucket_cap_mb` (25 MiB). After the first step `rebuild` refills them in the order the grads
actually arrived (rank 0's order, so every rank gets the same layout). Offsets are 16-byte aligned
so every view starts on a vector boundary for the pack/unpack kernels; a consumer that needs more
asks for it (`align_bytes=64` for the host device: JAX on the CPU aliases only 64-byte aligned memory).

A layout is plain, frozen data; memory and scheduling live elsewhere (memory.py, ddp/reducer.py,
bucket_submit.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence

import numpy as np

from nccl_ddp.errors import ConfigError

MiB = 1024 * 1024
DEFAULT_CAP_BYTES = 25 * MiB
FIRST_CAP_BYTES = 1 * MiB
ALIGN_BYTES = 16


class BucketCaps:
    """The bucket caps of a config with a `bucket_cap_mb` field (None: DEFAULT_CAP_BYTES), one
    rule for DDPConfig and ZeroConfig: every bucket's cap, and the first one's (smaller: it
    launches early)."""

    bucket_cap_mb: Optional[float]

    @property
    def cap_bytes(self) -> int:
        return DEFAULT_CAP_BYTES if self.bucket_cap_mb is None else int(self.bucket_cap_mb * MiB)

    @property
    def first_cap_bytes(self) -> int:
        return min(FIRST_CAP_BYTES, self.cap_bytes)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    shape: tuple
    dtype: np.dtype
    name: Optional[str] = None
    key: Hashable = None  # params with different keys never share a bucket (fusion ids)
    comm_fusion: Optional[int] = None  # a framework parameter's own fusion id (MindSpore)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def describe(self) -> str:
        return f"shape {tuple(self.shape)} {self.dtype}"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer: `params[k]` occupies elements [offsets[k], offsets[k] + numels[k])."""

    index: int
    dtype: np.dtype
    params: tuple
    offsets: tuple
    numels: tuple
    padded: int  # buffer length in elements (a multiple of the alignment)

    @property
    def numel(self) -> int:
        """Elements holding grads (the end of the last one)."""
        return self.offsets[-1] + self.numels[-1]

    @property
    def nbytes(self) -> int:
        return self.padded * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """All buckets in launch order, plus the reverse map param -> (bucket, slot), the one every
    consumer reads (the reducer's mark_ready, the flat buffers, the MindSpore graph cell):
    `bucket_of[i]` is parameter i's bucket index (-1: in no bucket, excluded), `unbucketed` those
    parameters, `locate(i)` its (bucket, slot)."""

    buckets: tuple
    num_params: int
    bucket_of: tuple = dataclasses.field(init=False, repr=False, compare=False)
    unbucketed: tuple = dataclasses.field(init=False, repr=False, compare=False)
    _where: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = {}
        bucket_of = [-1] * self.num_params
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                where[p] = (b.index, slot)
                bucket_of[p] = b.index
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "bucket_of", tuple(bucket_of))
        object.__setattr__(self, "unbucketed", tuple(i for i, b in enumerate(bucket_of) if b < 0))

    def locate(self, param: int) -> Optional[tuple]:
        """(bucket index, slot) of a parameter; None when it is in no bucket (excluded)."""
        return self._where.get(param)

    def summary(self) -> str:
        return "; ".join(
            f"bucket {b.index}: {len(b.params)} params {b.dtype} {b.nbytes} B" for b in self.buckets
        )


def bucket_tag(b: int, nbytes: int) -> str:
    """How collectives and errors name a bucket: "bucket 3 (1.0 MiB)"."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"bucket {b} ({nbytes / size:.1f} {unit})"
    return f"bucket {b} ({nbytes} B)"


def aligned(n: int, dtype: Any, align_bytes: int = ALIGN_BYTES) -> int:
    """`n` rounded up to a whole number of `align_bytes` units of `dtype` elements."""
    unit = max(1, align_bytes // np.dtype(dtype).itemsize)
    return -(-n // unit) * unit


def assign_buckets(
    specs: Sequence[ParamSpec],
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int = FIRST_CAP_BYTES,
    order: Optional[Sequence[int]] = None,
    exclude: Sequence[int] = (),
    align_bytes: int = ALIGN_BYTES,
) -> BucketLayout:
    """Fill buckets visiting params in `order` (default: reverse parameter order).

    Params of the same (dtype, key) share an open bucket until it holds at least its cap; the
    first bucket of each group is capped at `first_cap_bytes`. `cap_bytes == 0` gives one bucket per
    parameter. Buckets are returned in the order their first parameter was visited: the order in
    which they are expected to become ready. Params in `exclude` get no bucket. Every offset and
    the padded length are multiples of `align_bytes` (a multiple of 16).
    """
    if align_bytes < ALIGN_BYTES or align_bytes % ALIGN_BYTES:
        raise ConfigError(f"align_bytes must be a multiple of {ALIGN_BYTES}, got {align_bytes}")
    n = len(specs)
    if order is None:
        order = range(n - 1, -1, -1)
    excluded = set(exclude)
    visit = [i for i in dict.fromkeys(order) if i not in excluded]
    seen = set(visit)
    visit += [i for i in range(n - 1, -1, -1) if i not in excluded and i not in seen]
    open_: dict = {}
    caps_used: dict = {}
    closed: list = []

    def close(group: Hashable) -> None:
        closed.append(open_.pop(group))

    for i in visit:
        s = specs[i]
        group = (s.dtype, s.key)
        open_.setdefault(group, [])
        open_[group].append(i)
        cap = first_cap_bytes if caps_used.get(group, 0) == 0 else cap_bytes
        if sum(specs[j].numel for j in open_[group]) * np.dtype(s.dtype).itemsize >= cap:
            caps_used[group] = caps_used.get(group, 0) + 1
            close(group)
    closed += open_.values()
    rank_in_visit = {p: k for k, p in enumerate(visit)}
    closed.sort(key=lambda ps: rank_in_visit[ps[0]])
    return BucketLayout(tuple(_make_bucket(b, ps, specs, align_bytes) for b, ps in enumerate(closed)), n)


def _make_bucket(index: int, params: list, specs: Sequence[ParamSpec], align_bytes: int) -> Bucket:
    dtype = specs[params[0]].dtype
    offsets, numels, at = [], [], 0
    for p in params:
        offsets.append(at)
        numels.append(specs[p].numel)
        at = aligned(at + specs[p].numel, dtype, align_bytes)
    return Bucket(
        index, dtype, tuple(params), tuple(offsets), tuple(numels), max(at, aligned(1, dtype, align_bytes))
    )
