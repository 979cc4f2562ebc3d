"""PyTorch Lightning strategy: `Trainer(strategy=nccl_ddp.lightning.NcclDDPStrategy())` (see
docs/torch.md). Lightning is imported when the name is first used, not by `import nccl_ddp`."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nccl_ddp.adapters.torch.integrations.lightning import NcclDDPStrategy

__all__ = ["NcclDDPStrategy"]


def __getattr__(name: str) -> Any:
    if name == "NcclDDPStrategy":
        from nccl_ddp.adapters.torch.integrations.lightning import NcclDDPStrategy

        return NcclDDPStrategy
    raise AttributeError(f"module 'nccl_ddp.lightning' has no attribute {name!r}")
