"""nccl_ddp's adapter for toyfw, written as a third party would (docs/architecture.md, "adding a
framework"): `register()` adds it to nccl_ddp's table; `adapter` implements the contract."""

from nccl_ddp import frameworks


def register() -> None:
    """Make nccl_ddp send toyfw's objects to this package's adapter (each rank, before wrapping)."""
    frameworks.register("toyfw", frameworks.Framework("toyfw", "adapter", package="toyfw_nccl"))
