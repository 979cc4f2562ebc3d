"""Hugging Face Accelerate: `from nccl_ddp.accelerate import Accelerator` in place of accelerate's
(see docs/torch.md). Accelerate is imported when the name is first used, not by `import nccl_ddp`."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nccl_ddp.adapters.torch.integrations.accelerate import Accelerator

__all__ = ["Accelerator"]


def __getattr__(name: str) -> Any:
    if name == "Accelerator":
        from nccl_ddp.adapters.torch.integrations.accelerate import Accelerator

        return Accelerator
    raise AttributeError(f"module 'nccl_ddp.accelerate' has no attribute {name!r}")
