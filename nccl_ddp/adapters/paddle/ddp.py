"""`DistributedDataParallel` of a `paddle.nn.Layer` is itself a `paddle.nn.Layer`, as
`paddle.DataParallel` is: the wrapped layer is `_layers` (so `named_parameters()` carry Paddle's
`_layers.` prefix), `state_dict()` / `set_state_dict()` are the wrapped layer's (the same keys as
`paddle.DataParallel`'s, so checkpoints load either way), `no_sync()` accumulates locally, and
Paddle's keyword arguments are accepted (`comm_buffer_size` is our bucket cap; one we cannot
honour is a `ConfigError` saying why). Parameters, frozen ones and buffers (BatchNorm's running
statistics) are broadcast from rank 0 at construction, as Paddle does; with broadcast_buffers=True
(the default) buffers are also broadcast before each synchronised forward, as torch DDP does
(Paddle keeps them per rank after construction: broadcast_buffers=False keeps them per rank
throughout, construction included).
"""

from __future__ import annotations

from typing import Any, cast

import paddle

from nccl_ddp.adapters.paddle.adapter import PaddleModule
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.errors import ConfigError, ConfigTypeError


class PaddleDistributedDataParallel(paddle.nn.Layer, DistributedDataParallel):
    """What `nccl_ddp.DistributedDataParallel(layer, ...)` builds for a Paddle Layer: the core's
    arguments plus `paddle.DataParallel`'s keywords."""

    def __init__(
        self,
        layers: Any,
        *args: Any,
        strategy: Any = None,
        comm_buffer_size: float = 25,
        last_comm_buffer_size: float = 1,
        group: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(layers, paddle.nn.Layer):
            raise ConfigTypeError(
                f"layers must be a paddle.nn.Layer, got {type(layers).__module__}.{type(layers).__name__}"
            )
        _check_paddle_options(strategy, last_comm_buffer_size, group)
        if comm_buffer_size != 25:
            if kwargs.get("bucket_cap_mb") is not None:
                raise ConfigError("pass comm_buffer_size or bucket_cap_mb, not both: they are the same cap")
            kwargs["bucket_cap_mb"] = comm_buffer_size
        paddle.nn.Layer.__init__(self, layers.full_name() + "_data_parallel")
        self._layers = layers
        DistributedDataParallel.__init__(self, layers, *args, **kwargs)
        # `module` (the core's name) is a plain attribute: the Layer is registered once, as _layers
        self._sub_layers.pop("module", None)
        object.__setattr__(self, "module", layers)

    @property
    def _paddle_module(self) -> PaddleModule:
        return cast(PaddleModule, self._adapter)  # __init__ built it for a Layer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._pre_forward()
        return self._adapter.forward(*inputs, **kwargs)

    def zero_grad(self) -> None:
        """Paddle's `clear_gradients()` of the wrapped layer, and our accumulated grads."""
        self._layers.clear_gradients()
        super().zero_grad()

    def close(self) -> None:
        """Wait for pending communication and stop the comm stream; the grad hooks do nothing
        from now on."""
        self._paddle_module.detach()
        super().close()

    # ---- what code written for paddle.DataParallel reads
    @property
    def find_unused_parameters(self) -> bool:
        return self.config.find_unused_parameters

    @property
    def grad_need_sync(self) -> bool:
        """Whether the next step all-reduces (Paddle's flag; no_sync() clears it)."""
        return self.reducer.sync_enabled

    @grad_need_sync.setter
    def grad_need_sync(self, value: bool) -> None:
        self.reducer.sync_enabled = bool(value)

    def scale_loss(self, loss: Any) -> Any:
        """`loss` as it is: Paddle's own has done nothing since Paddle 2.0 (deprecated), grads
        are averaged in the all-reduce."""
        return loss

    def apply_collective_grads(self) -> None:
        """Nothing, as Paddle's own since 2.0 (deprecated): backward's hooks all-reduce."""

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped layer's state dict (`paddle.DataParallel`'s keys: no prefix)."""
        return self._layers.state_dict(*args, **kwargs)

    def set_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._layers.set_state_dict(*args, **kwargs)

    set_dict = set_state_dict
    load_dict = set_state_dict


def _check_paddle_options(strategy: Any, last_comm_buffer_size: float, group: Any) -> None:
    if strategy is not None:
        raise ConfigError(
            "strategy (a paddle ParallelStrategy) is not used: nccl_ddp reads the ranks from its "
            "launcher's environment; leave it None (the second positional argument is init_sync)"
        )
    if last_comm_buffer_size != 1:
        raise ConfigError(
            f"last_comm_buffer_size={last_comm_buffer_size!r}: our first bucket is capped at "
            "min(1 MiB, comm_buffer_size); leave it 1"
        )
    if group is not None:
        raise ConfigError(
            "group must be None: nccl_ddp reduces over its own process group; pass "
            "process_group=nccl_ddp.new_group(ranks) for a subgroup"
        )
