"""Framework-free optimizers over flat float32 shards (ZeRO): torch.optim.SGD and AdamW semantics,
one fused kernel launch per shard on CuPy arrays (kernels/optim.cu), the NumPy reference on NumPy
arrays. State lives in flat arrays beside the shard, under torch's state names, so a checkpoint
can hold it in torch's format.

    opt = ShardAdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    state = opt.init_state(master)                    # one per shard, zeros, master's device
    opt.step(master, grad, state, params_out=bf16_params, grad_scale=1 / world)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool


def _number(owner: str, name: str, value: Any, *, low: float = 0.0, below: Optional[float] = None) -> None:
    """A finite real `value` with low <= value (< below): else ConfigTypeError/ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigTypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        limit = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise ConfigError(f"{owner}: {name} must be finite and {limit}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SGDConfig:
    """torch.optim.SGD's hyperparameters (maximize, foreach and fused have no meaning here)."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            _number("ShardSGD", name, getattr(self, name))
        check_bool("nesterov", self.nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                "ShardSGD: nesterov=True needs momentum > 0 and dampening == 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening}), as "
                "torch.optim.SGD"
            )


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """torch.optim.AdamW's hyperparameters (maximize, capturable, foreach, fused excluded)."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False

    def __post_init__(self) -> None:
        _number("ShardAdamW", "lr", self.lr)
        _number("ShardAdamW", "eps", self.eps)
        _number("ShardAdamW", "weight_decay", self.weight_decay)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ConfigTypeError(f"ShardAdamW: betas must be a pair (beta1, beta2), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _number("ShardAdamW", f"betas[{i}]", b, below=1.0)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        check_bool("amsgrad", self.amsgrad)


@dataclasses.dataclass
class ShardState:
    """One shard's optimizer state: `step` (steps taken) and float32 arrays of the shard's size
    under torch's state names (momentum_buffer; exp_avg, exp_avg_sq, max_exp_avg_sq)."""

    step: int
    buffers: Dict[str, Any]


def _zeros_like(master: Any) -> Any:
    """float32 zeros of master's size on master's device."""
    if isinstance(master, np.ndarray):
        return np.zeros(master.size, np.float32)
    from nccl_ddp.device.cuda import CudaDevice

    return CudaDevice(master.device.id).zeros(master.size, np.float32)


class _ShardOptimizer:
    """What both optimizers share: state allocation, the per-step lr and the state checks."""

    config: Any

    def state_names(self) -> Tuple[str, ...]:
        """The state arrays this optimizer keeps per shard (torch's names)."""
        raise NotImplementedError

    def init_state(self, master: Any) -> ShardState:
        """Zero state for the shard `master` (a flat float32 NumPy or CuPy array)."""
        return ShardState(0, {name: _zeros_like(master) for name in self.state_names()})

    def _lr(self, lr: Optional[float]) -> float:
        if lr is None:
            return float(self.config.lr)
        _number(type(self).__name__, "lr", lr)
        return float(lr)

    def _buffers(self, state: ShardState) -> Dict[str, Any]:
        if not isinstance(state, ShardState):
            raise ConfigTypeError(
                f"{type(self).__name__}.step: state must be the ShardState of "
                f"init_state(master), got {type(state).__name__}"
            )
        missing = [n for n in self.state_names() if n not in state.buffers]
        if missing:
            raise ConfigError(
                f"{type(self).__name__}.step: the state has no {missing} (built by "
                "another optimizer or settings?); make it with init_state(master)"
            )
        return state.buffers


class ShardSGD(_ShardOptimizer):
    """torch.optim.SGD on flat float32 shards (bitwise equal to torch's CPU step on float32)."""

    def __init__(
        self,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.config = SGDConfig(lr, momentum, dampening, weight_decay, nesterov)

    def state_names(self) -> Tuple[str, ...]:
        return ("momentum_buffer",) if self.config.momentum != 0 else ()

    def step(
        self,
        master: Any,
        grad: Any,
        state: ShardState,
        params_out: Optional[Any] = None,
        *,
        grad_scale: float = 1.0,
        lr: Optional[float] = None,
    ) -> None:
        """One step in place: master and state updated from grad * grad_scale; params_out (the
        low-precision model copy of this shard, or None) := the new master cast. `lr` overrides
        the configured one for this step (a schedule)."""
        buffers, c = self._buffers(state), self.config
        _number("ShardSGD.step", "grad_scale", grad_scale, low=-math.inf)
        kernels.sgd_step(
            master,
            grad,
            buffers.get("momentum_buffer"),
            params_out,
            lr=self._lr(lr),
            momentum=c.momentum,
            dampening=c.dampening,
            weight_decay=c.weight_decay,
            nesterov=c.nesterov,
            fresh_buffer=state.step == 0,
            grad_scale=grad_scale,
        )
        state.step += 1


class ShardAdamW(_ShardOptimizer):
    """torch.optim.AdamW on flat float32 shards (states bitwise equal to torch's CPU step on
    float32; parameters within an ulp where torch's CPU sqrt is not correctly rounded)."""

    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        self.config = AdamWConfig(lr, betas, eps, weight_decay, amsgrad)

    def state_names(self) -> Tuple[str, ...]:
        extra = ("max_exp_avg_sq",) if self.config.amsgrad else ()
        return ("exp_avg", "exp_avg_sq") + extra

    def step(
        self,
        master: Any,
        grad: Any,
        state: ShardState,
        params_out: Optional[Any] = None,
        *,
        grad_scale: float = 1.0,
        lr: Optional[float] = None,
    ) -> None:
        """One step in place (see ShardSGD.step)."""
        buffers, c = self._buffers(state), self.config
        _number("ShardAdamW.step", "grad_scale", grad_scale, low=-math.inf)
        kernels.adamw_step(
            master,
            grad,
            buffers["exp_avg"],
            buffers["exp_avg_sq"],
            buffers.get("max_exp_avg_sq"),
            params_out,
            step=state.step + 1,
            lr=self._lr(lr),
            beta1=c.betas[0],
            beta2=c.betas[1],
            eps=c.eps,
            weight_decay=c.weight_decay,
            amsgrad=c.amsgrad,
            grad_scale=grad_scale,
        )
        state.step += 1
