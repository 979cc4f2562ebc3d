"""check_finite, for `DistributedDataParallel` and `DistributedGradReducer` alike: one int32 flag
per bucket, raised by the pack kernel when it writes a NaN/Inf, summed across the ranks by the
owner after the step's buckets, and read once: when asked (`last_step_finite`) or, with "raise",
at the end of the step (`NonFiniteGradError` on every rank, naming the first flagged bucket)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from nccl_ddp.buckets.layout import BucketLayout, bucket_tag
from nccl_ddp.buckets.memory import to_host
from nccl_ddp.ddp.config import CheckFinite
from nccl_ddp.device import Device
from nccl_ddp.errors import ConfigError, NonFiniteGradError


def require_check(check: CheckFinite, rank: int, owner: str) -> None:
    """`last_step_finite` without the option is a mistake: say how to switch it on."""
    if not check:
        raise ConfigError(
            f'rank {rank}: last_step_finite needs check_finite=True (or "raise") when the {owner} is built'
        )


class FiniteCheck:
    """The flags of one step at a time. `open()` starts a step; the owner hands `flag(b)` to the
    pack of bucket b and all-reduces `flags` (SUM) after the buckets, then makes the compute
    stream wait for that. `settle()` waits until the reduced flags can be read on the host;
    `label(i)` names parameter i in the error."""

    def __init__(
        self,
        check: CheckFinite,
        device: Device,
        rank: int,
        settle: Callable[[], None],
        label: Callable[[int], str],
    ) -> None:
        self.check, self.device, self.rank = check, device, rank
        self._settle, self._label = settle, label
        self.flags: Any = None  # this step's device flags (None before the first step)
        self._host: Optional[np.ndarray] = None
        self._layout: Optional[BucketLayout] = None
        self._step = -1

    def open(self, layout: BucketLayout, step: int) -> Any:
        """Fresh zero flags for a step over `layout`; returns them."""
        self.flags = self.device.zeros(max(1, len(layout.buckets)), np.int32)
        self._layout, self._host, self._step = layout, None, step
        return self.flags

    def flag(self, b: int) -> Any:
        """Bucket b's flag (a one-element view) for the pack kernel."""
        return self.flags[b : b + 1]

    def finite(self) -> Optional[bool]:
        """Whether the last step's grads were finite on every rank (None before the first);
        the first read waits for the flags."""
        if self.flags is None:
            return None
        if self._host is None:
            self._settle()
            self._host = np.asarray(to_host(self.flags))
        return not bool(self._host.any())

    def raise_if_flagged(self) -> None:
        """With "raise": `NonFiniteGradError` when a bucket of the last step was flagged."""
        if self.check != "raise" or self.finite() is not False:
            return
        layout, host = self._layout, self._host
        if layout is None or host is None:  # finite() has read both
            return
        bad = [int(b) for b in np.flatnonzero(host)]
        bucket = layout.buckets[bad[0]]
        names = ", ".join(self._label(p) for p in bucket.params[:20]) + (
            f" and {len(bucket.params) - 20} more" if len(bucket.params) > 20 else ""
        )
        raise NonFiniteGradError(
            f"rank {self.rank}: step {self._step} produced non-finite grads (NaN or Inf) on at "
            f"least one rank: first in {bucket_tag(bad[0], bucket.nbytes)}, which holds "
            f"parameters {names}; buckets flagged: {bad}. The step's grads are reduced (and "
            "non-finite); skip the optimizer step and zero the grads, or lower the learning rate"
        )
