"""`DistributedDataParallel` of a MindSpore `nn.Cell` is itself an `nn.Cell`, as MindSpore's own
is: built with `auto_prefix=False`, so `parameters_dict()`, `trainable_params()` and checkpoints
(`mindspore.save_checkpoint(ddp, path)`) carry the wrapped cell's own parameter names, and a
checkpoint loads into the bare cell and the reverse. Calling it runs `construct`: the step opens
(buffers from rank 0 first when due), then the wrapped cell runs. PyNative mode only, as the
grad hooks need it.
"""
from __future__ import annotations

from typing import Any, Optional

from mindspore import nn

from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.ddp.data_parallel import DistributedDataParallel


class MindSporeDistributedDataParallel(nn.Cell, DistributedDataParallel):
    """What `nccl_ddp.DistributedDataParallel(cell, ...)` builds for a MindSpore Cell."""

    def __init__(self, module: Any, init_sync: bool = True, process_group: Any = None,
                 bucket_cap_mb: Optional[float] = None, find_unused_parameters: bool = False,
                 average_in_collective: bool = False, static_graph: bool = False,
                 reducer_mode: str = "CppReducer", *, broadcast_buffers: bool = True,
                 config: Optional[DDPConfig] = None) -> None:
        nn.Cell.__init__(self, auto_prefix=False)
        DistributedDataParallel.__init__(
            self, module, init_sync, process_group, bucket_cap_mb, find_unused_parameters,
            average_in_collective, static_graph, reducer_mode,
            broadcast_buffers=broadcast_buffers, config=config)

    def construct(self, *inputs: Any, **kwargs: Any) -> Any:
        self._pre_forward()
        return self._adapter.forward(*inputs, **kwargs)
