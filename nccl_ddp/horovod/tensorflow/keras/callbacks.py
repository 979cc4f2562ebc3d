"""Horovod's Keras callbacks (horovod/_keras/callbacks.py) for Keras 3.

Keras 3 names the learning rate `optimizer.learning_rate` (a variable: assigned, not set through
`K.set_value`) and has no `optimizer.variables()` method (a list attribute).
BroadcastGlobalVariablesCallback broadcasts when training begins if the model is built (the
optimizer is built first, so its state exists): every rank's first step then starts from the
same variables; a model that its first batch builds is broadcast after that batch, as Horovod's.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import keras
import numpy as np

from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod import common
from nccl_ddp.horovod.tensorflow.ops import allreduce


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank starts training from `root_rank`'s model variables and optimizer state, except
    `local_variables` (and those given to `register_local_var`), which each rank keeps."""

    def __init__(
        self, root_rank: int, device: str = "", local_variables: Optional[Sequence[Any]] = None
    ) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.done = False
        self._local: List[Any] = list(local_variables or [])

    def register_local_var(self, var: Any) -> None:
        """A variable that each rank keeps as it is (not broadcast)."""
        self._local.append(var)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.model.built and self.model.variables:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.done:  # a model built by its first batch: after that step, as Horovod does
            self._broadcast()

    def _broadcast(self) -> None:
        from nccl_ddp.adapters.keras.adapter import broadcast_variables

        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        group = common.global_process_set.group("BroadcastGlobalVariablesCallback")
        shared = [v for v in self.model.variables if not any(v is lo for lo in self._local)]
        broadcast_variables(shared, self.root_rank, group)
        if optimizer is not None:
            broadcast_variables(optimizer.variables, self.root_rank, group)
        self.done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every metric in `logs` becomes its mean over the ranks (put it before
    callbacks that read metrics: ReduceLROnPlateau, TensorBoard, checkpoints)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        names = sorted(logs)  # the same order on every rank
        values = [np.asarray(logs[n], np.float64) for n in names]
        reduced = allreduce(np.stack(values), op=common.Average)
        for n, v in zip(names, np.asarray(reduced)):
            logs[n] = float(v)


def _lr(optimizer: Any) -> float:
    return float(np.asarray(optimizer.learning_rate))


def _set(variable_owner: Any, attr: str, value: float) -> None:
    current = getattr(variable_owner, attr)
    if hasattr(current, "assign"):
        current.assign(value)
    else:
        setattr(variable_owner, attr, value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Learning rate `initial_lr * multiplier(epoch)` from `start_epoch` to `end_epoch` (per epoch
    with `staircase`, else per batch with fractional epochs); `multiplier` a number means
    `multiplier ** (epoch - start_epoch)`. With momentum_correction the momentum is scaled by
    new_lr / old_lr for the batch that changes the rate (Goyal et al.)."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: Union[float, Callable[[float], float]],
        start_epoch: int = 0,
        end_epoch: Optional[int] = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ConfigError("LearningRateScheduleCallback: initial_lr is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda e: multiplier ** (e - start_epoch))
        self.current_epoch = 0
        self.restore_momentum: Optional[float] = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigError(
                    f"{type(self).__name__}: cannot tell the steps per epoch; pass steps_per_epoch="
                )
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def _steps(self) -> int:
        if not self.steps_per_epoch:
            raise ConfigError(f"{type(self).__name__}: steps_per_epoch is unknown; pass steps_per_epoch=")
        return self.steps_per_epoch

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        old, new = _lr(opt), self.initial_lr * self.multiplier(epoch)
        _set(opt, "learning_rate", new)
        if self.momentum_correction and getattr(opt, "momentum", None) and old:
            self.restore_momentum = float(np.asarray(opt.momentum))
            _set(opt, "momentum", self.restore_momentum * new / old)

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self._steps())

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.restore_momentum is not None:
            _set(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = _lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """The rate grows from `initial_lr / size` to `initial_lr` over `warmup_epochs` (per batch)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self._steps()  # round numbers at each epoch's end, as Horovod's
            n = common.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose
