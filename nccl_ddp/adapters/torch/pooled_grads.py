"""`p.grad` under ZeRO-2 (`DistributedDataParallel(module, zero=ZeroConfig(stage=2))`): the
framework's own grads, handed to the reducer bucket by bucket and let go after the step.

Backward accumulates into `p.grad` as torch allocates it (no bucket views); each parameter's
hook hands that tensor to the reducer (`reducer.grads[i]`), which packs a ready bucket into the
shard core's `GradPool` (one bucket-sized buffer per dtype, reused in comm-stream order) and
reduce-scatters it into this rank's shard. The reducer drops its references once the compute
stream has waited for every bucket (so torch's caching allocator may reuse the memory only after
the comm stream read it; on the host backend the queued pack holds the array itself). After a
synchronised backward each `p.grad` becomes a placeholder: a stride-0 view of one element of a
small per-dtype flag tensor (the right shape, dtype and device, no memory of the grad's size),
which the optimizer's `GradGuard` then guards as a `LocalGrad`. So no full-size grad buffer
outlives the step: the reduced grads exist only as this rank's shard.

The placeholder's element says what the next backward does: 1 (as left by the step) means the
grads were not zeroed, so that step adds its reduced grads to the shards (torch's accumulation
without `zero_grad()`); 0 (`zero_grad(set_to_none=False)` zeroed it) means it starts from zero.
`no_sync()`: the local grads accumulate in `p.grad` (real tensors) until the next synchronised
backward, which reduces them; local grad memory exists only while inside such a run.
`open()` runs at our forward, or, when the module is called directly, at the first grad of the
backward (a tensor hook that runs before torch accumulates it).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.ddp.interfaces import StepDriver
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.reduce_scatter import ReduceScatter


class PooledGrads:
    """The placeholders and the per-step hand-over of `params`' grads to `driver` (the wrapper's
    step), whose shard core reduce-scatters them (`sharding`); `to_native(tensor)`: the native
    array the reducer packs from (adapters/torch/adapter.py's)."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        driver: StepDriver,
        sharding: ReduceScatter,
        to_native: Callable[[torch.Tensor], NativeArray],
    ) -> None:
        self.params, self.driver, self.sharding, self._to_native = params, driver, sharding, to_native
        dtypes = {p.dtype for p in params}
        device = params[0].device
        self._flags: Dict[torch.dtype, torch.Tensor] = {
            dt: torch.ones(len(params), dtype=dt, device=device) for dt in dtypes
        }
        self._zeroed: List[int] = []  # zeroed placeholders set to None for this backward

    @property
    def nbytes(self) -> int:
        """Bytes the placeholders hold (all of them: one element per parameter and dtype)."""
        return sum(int(f.nbytes) for f in self._flags.values())

    def _placeholder(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self._flags[p.dtype][i].expand(p.shape)

    def _is_placeholder(self, i: int, g: torch.Tensor) -> bool:
        p = self.params[i]
        return (
            g.dtype == p.dtype
            and g.device == p.device
            and g.data_ptr() == self._flags[p.dtype][i].data_ptr()
            and all(s == 0 for s in g.stride())
        )

    def open(self, syncing: bool) -> List[int]:
        """Before backward: placeholders become None (torch allocates the new grads), stale
        ones (not zeroed) make the step accumulate into the shards. Returns the parameters
        whose `.grad` was None (torch keeps None for one no rank used)."""
        with torch._C.DisableTorchFunctionSubclass():
            grads = [p.grad for p in self.params]
            marks = [g is not None and self._is_placeholder(i, g) for i, g in enumerate(grads)]
            values = {dt: f.tolist() for dt, f in self._flags.items()} if any(marks) else {}
        stale = [i for i, m in enumerate(marks) if m and values[self.params[i].dtype][i]]
        self._zeroed = [i for i, m in enumerate(marks) if m and not values[self.params[i].dtype][i]]
        if stale and self._zeroed:
            raise ConfigError(
                f"rank {self.driver.group.rank}: under ZeRO-2 some p.grad were zeroed since the "
                f"last step and others not (not zeroed: parameters {stale[:5]}); the reduced "
                "grads are kept as shards of whole buckets, so zero all of them "
                "(opt.zero_grad()) or none (to accumulate)"
            )
        for i, m in enumerate(marks):
            if m:
                self.params[i].grad = None
        if stale:
            self.sharding.accumulate = True
        return [i for i, g in enumerate(grads) if g is None]

    def hand_over(self, i: int, p: torch.nn.Parameter) -> None:
        """Parameter i's hook: its grad (as torch accumulated it) is what the reducer packs."""
        with torch._C.DisableTorchFunctionSubclass():  # (a LocalGrad kept across no_sync())
            self.driver.grads[i] = self._to_native(p.grad)

    def end(self, syncing: bool) -> None:
        """After a backward (its step finalized): a synchronised one leaves placeholders in place
        of the grads it reduced (and of zeroed ones no rank used: torch keeps them as zeros)."""
        if not syncing:
            return
        self.sharding.accumulate = False
        for f in self._flags.values():
            f.fill_(1)
        for i in self._zeroed:
            if self.params[i].grad is None:
                self._flags[self.params[i].dtype][i] = 0
                self.params[i].grad = self._placeholder(i)
        self._zeroed = []
        for i, p in enumerate(self.params):
            if p.grad is not None:
                p.grad = self._placeholder(i)
