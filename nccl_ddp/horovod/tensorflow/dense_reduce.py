"""The fused reduction of dense tensors that allreduce / grouped_allreduce (ops.py) run, with
Horovod's gradient (the same reduction of the upstream grads); the data-moving collectives'
gradients (movement.py) average with it too."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.horovod import collectives
from nccl_ddp.horovod.arrays import host
from nccl_ddp.horovod.tensorflow.host_call import on_host
from nccl_ddp.horovod.tensorflow.tensors import native, sub_name, upstream


def reduce_dense(
    tensors: List[tf.Tensor],
    op: int,
    pre: float,
    post: float,
    g: ProcessGroup,
    where: str,
    name: Optional[str],
) -> List[tf.Tensor]:
    """The fused reduction of dense tensors, with Horovod's gradient."""

    def run(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        natives = [native(a, g) for a in arrays]
        collectives.grouped_allreduce_(natives, op, pre, post, g, where)
        return [host(n).reshape(a.shape) for n, a in zip(natives, arrays)]

    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> tuple:
        outs = on_host(run, xs, [x.dtype for x in xs], "HorovodAllreduce", name)
        for o, x in zip(outs, xs):
            o.set_shape(x.shape)

        def grad(*dys: Optional[tf.Tensor]) -> List[tf.Tensor]:
            return reduce_dense(upstream(dys, outs), op, pre, post, g, where, sub_name(name, "grad"))

        return outs, grad

    return list(reduce(*tensors))
