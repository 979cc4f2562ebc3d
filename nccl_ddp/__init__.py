"""nccl_ddp: data-parallel gradient communication for any DLPack framework.

`import nccl_ddp` needs only NumPy; CuPy, NCCL and the frameworks load when first used.
"""
from . import errors
from .errors import NcclDdpError

__version__ = "0.1.0"
