"""Adding a framework from another package: the public face of `nccl_ddp.arrays.frameworks`,
where the adapter table lives (`register(top_module, Framework(...))`, docs/architecture.md)."""

from nccl_ddp.arrays.frameworks import ADAPTERS, Framework, NativeArray, register

__all__ = ["ADAPTERS", "Framework", "NativeArray", "register"]
