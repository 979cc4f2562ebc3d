"""Hugging Face transformers: `from nccl_ddp.transformers import Trainer` in place of
transformers' (see docs/torch.md); `with_nccl_ddp(cls)` for Trainer subclasses. transformers is
imported when a name is first used, not by `import nccl_ddp`."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nccl_ddp.adapters.torch.integrations.transformers import Trainer, with_nccl_ddp

__all__ = ["Trainer", "with_nccl_ddp"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nccl_ddp.adapters.torch.integrations import transformers

        return getattr(transformers, name)
    raise AttributeError(f"module 'nccl_ddp.transformers' has no attribute {name!r}")
