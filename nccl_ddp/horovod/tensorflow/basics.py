"""Horovod's TensorFlow ops for the ranks (rank_op, size_op, local_rank_op, local_size_op) and
broadcast_global_variables (TensorFlow 1's graph collections)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from nccl_ddp.errors import NcclDdpError
from nccl_ddp.horovod import common
from nccl_ddp.horovod.tensorflow.movement import broadcast_variables


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return tf.constant(common.rank(), tf.int32, name=name or "HorovodRank")


def size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of processes, as an int32 tensor."""
    return tf.constant(common.size(), tf.int32, name=name or "HorovodSize")


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor."""
    return tf.constant(common.local_rank(), tf.int32, name=name or "HorovodLocalRank")


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of processes on this node, as an int32 tensor."""
    return tf.constant(common.local_size(), tf.int32, name=name or "HorovodLocalSize")


class EagerGlobalVariablesError(NcclDdpError, RuntimeError):
    """broadcast_global_variables called eagerly, where TensorFlow keeps no global variables."""


def broadcast_global_variables(root_rank: int) -> Optional[tf.Operation]:
    """In a TensorFlow 1 graph: the op assigning `root_rank`'s values to every global variable.
    Eagerly there are none (RuntimeError, as Horovod's)."""
    if tf.executing_eagerly():
        raise EagerGlobalVariablesError(
            "hvd.broadcast_global_variables() does not support eager execution (there are no "
            "global variables); use hvd.broadcast_variables(model.variables, root_rank), or "
            "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) with Keras"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


__all__ = ["broadcast_global_variables", "local_rank_op", "local_size_op", "rank_op", "size_op"]
