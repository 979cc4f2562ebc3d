"""Keras 3 data parallelism: `DistributedOptimizer(keras.optimizers.Adam(...))` for `model.fit`,
`BroadcastGlobalVariablesCallback(root_rank)` and `broadcast_variables(variables, root_rank)`
(see docs/frameworks.md, "TensorFlow and Keras 3"). Keras is imported when a name is first used,
not by `import nccl_ddp`.

    model.compile(optimizer=nccl_ddp.keras.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    model.fit(x, y, callbacks=[nccl_ddp.keras.BroadcastGlobalVariablesCallback(0)])
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    BroadcastGlobalVariablesCallback: Any  # a keras.callbacks.Callback subclass, made on first use

__all__ = [
    "DistributedOptimizer",
    "BroadcastGlobalVariablesCallback",
    "broadcast_variables",
    "broadcast_model_and_optimizer",
]


def DistributedOptimizer(optimizer: Any, **kwargs: Any) -> Any:
    """Keras 3 `optimizer`'s class and config, with grads all-reduced in `apply()` before Keras
    clips and applies them; keywords: mean, compress, fusion_type, group."""
    from nccl_ddp.adapters.keras.adapter import DistributedOptimizer as make

    return make(optimizer, **kwargs)


def broadcast_variables(variables: Any, root_rank: int = 0, group: Any = None) -> None:
    """Every rank gets `root_rank`'s values of `variables` (Keras or TensorFlow variables)."""
    from nccl_ddp.adapters.keras.adapter import broadcast_variables as bcast

    bcast(variables, root_rank, group)


def broadcast_model_and_optimizer(model: Any, root_rank: int = 0, group: Any = None) -> None:
    """Every rank gets `root_rank`'s model variables and optimizer state (building it first)."""
    from nccl_ddp.adapters.keras.adapter import broadcast_model_and_optimizer as bcast

    bcast(model, root_rank, group)


def __getattr__(name: str) -> Any:
    if name == "BroadcastGlobalVariablesCallback":  # `(root_rank=0, group=None)`: a Keras callback
        from nccl_ddp.adapters.keras.adapter import callback_class

        return callback_class()
    raise AttributeError(f"module 'nccl_ddp.keras' has no attribute {name!r}")
