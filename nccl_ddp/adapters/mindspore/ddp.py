"""`DistributedDataParallel` of a MindSpore `nn.Cell` is itself an `nn.Cell`, as MindSpore's own
is: built with `auto_prefix=False`, so `parameters_dict()`, `trainable_params()` and checkpoints
(`mindspore.save_checkpoint(ddp, path)`) carry the wrapped cell's own parameter names, and a
checkpoint loads into the bare cell and the reverse. Calling it runs `construct`: the step opens
(buffers from rank 0 first when due), then the wrapped cell runs. PyNative mode only, as the
grad hooks need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mindspore import nn

from nccl_ddp.ddp.data_parallel import DistributedDataParallel

if TYPE_CHECKING:
    import mindspore


class MindSporeDistributedDataParallel(nn.Cell, DistributedDataParallel):
    """What `nccl_ddp.DistributedDataParallel(cell, ...)` builds for a MindSpore Cell."""

    def __init__(self, module: mindspore.nn.Cell, *args: Any, **kwargs: Any) -> None:  # the core's
        # the core's signature (MindSpore's, and every option it grows) as it is
        nn.Cell.__init__(self, auto_prefix=False)
        DistributedDataParallel.__init__(self, module, *args, **kwargs)

    def construct(self, *inputs: object, **kwargs: object) -> object:
        self._pre_forward()
        return self._adapter.forward(*inputs, **kwargs)
