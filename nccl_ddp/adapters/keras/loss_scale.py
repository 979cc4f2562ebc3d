"""Keras' `LossScaleOptimizer` around our `DistributedOptimizer` skips or applies on every rank alike.

`model.compile` under `mixed_float16` (or a user) wraps our optimizer in Keras'
`LossScaleOptimizer`, which checks the *local* grads for overflow and calls our `apply()` (where
the reduction runs) only when they are finite: an overflow on one rank would make the ranks skip
different steps and pair their all-reduces with other steps. Its `check_finite` is made
collective for such an optimizer: every rank's verdict is summed over the group, so every rank
skips (and halves its scale) when any rank overflowed, as one process would on the whole batch,
and otherwise every rank reduces and applies. `LossScaleOptimizer`s around anything else keep
Keras' check untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from nccl_ddp.ddp.interfaces import GradsAdapter


@functools.cache
def install(ours: type[Any], grads_adapter: Callable[[], GradsAdapter]) -> None:
    """Make `keras.optimizers.LossScaleOptimizer.check_finite` collective when its inner optimizer
    is an instance of `ours` (once per process); `grads_adapter()`: the backend's grads adapter."""
    import keras

    cls = keras.optimizers.LossScaleOptimizer
    local_check = cls.check_finite

    def check_finite(self: Any, grads: Any) -> Any:
        finite = local_check(self, grads)
        inner = getattr(self, "inner_optimizer", None)
        if not isinstance(inner, ours):
            return finite
        return agreed(finite, inner._nccl_ddp_settings.get("group"), grads_adapter())

    check_finite.__doc__ = "Keras' check, summed over the ranks when the inner optimizer is nccl_ddp's."
    cls.check_finite = check_finite


def agreed(finite: Any, group: Any, grads: GradsAdapter) -> Any:
    """True on every rank when every rank's `finite` is: the count of ranks with non-finite grads,
    all-reduced over `group` (eagerly, or inside the backend's traced step through
    its host callback), equals zero."""
    import keras

    from nccl_ddp.comm import collectives

    bad = keras.ops.reshape(keras.ops.cast(keras.ops.logical_not(finite), "float32"), (1,))

    def count(arrays: list) -> list:
        return [collectives.all_reduce(arrays[0], op="sum", group=group)]

    (total,) = grads.reduce(count, [bad])
    return keras.ops.equal(keras.ops.sum(total), 0.0)
