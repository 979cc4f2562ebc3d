"""A token bucket on the TCP links between nodes, for tests and benchmarks that need a slow
network on one machine (NCCL_DDP_HOST_THROTTLE_BPS bytes per second per link; unset or 0: off,
the default)."""

from __future__ import annotations

import threading
import time
from typing import Optional

from nccl_ddp.job.env import env_int

BURST_S = 0.01  # the bucket holds this many seconds of traffic


class TokenBucket:
    """`take(n)` returns once n bytes fit the rate (sleeping meanwhile); at most `rate` bytes a
    second pass on average, bursts up to BURST_S seconds' worth."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self.capacity = max(1.0, self.rate * BURST_S)
        self._tokens = self.capacity
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n  # may go negative: the debt is slept off below
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def from_env() -> Optional[TokenBucket]:
    """The throttle NCCL_DDP_HOST_THROTTLE_BPS asks for (one per link), or None."""
    rate = env_int("NCCL_DDP_HOST_THROTTLE_BPS", 0)
    return TokenBucket(rate) if rate > 0 else None
