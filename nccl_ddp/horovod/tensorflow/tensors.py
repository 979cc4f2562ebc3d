"""What the TensorFlow facade's collectives share: inputs as dense tensors, native arrays of the
group's backend, Compression, and the names of their parts' and gradients' collectives."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigTypeError
from nccl_ddp.horovod.arrays import xp_of
from nccl_ddp.horovod.compression import HalfCompressor, NoneCompressor

TensorLike = Union[tf.Tensor, tf.Variable, tf.IndexedSlices, np.ndarray, float, int, list]


class FP16Compressor(HalfCompressor):
    """Floating-point tensors travel as tf.float16, and come back in their own dtype."""

    half = tf.float16

    @staticmethod
    def cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        return tf.cast(tensor, dtype)

    @staticmethod
    def is_float(dtype: tf.DType) -> bool:
        return bool(dtype.is_floating)


class Compression:
    """`compression=Compression.none` or `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor


def dense(t: TensorLike, where: str) -> tf.Tensor:
    """`t` as a dense tensor (a variable's value; IndexedSlices scattered: Horovod's sparse_as_dense)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.convert_to_tensor(t)
    if isinstance(t, tf.Variable):
        return t.read_value()
    if not isinstance(t, tf.Tensor):
        try:
            return tf.convert_to_tensor(t)
        except (TypeError, ValueError) as e:
            raise ConfigTypeError(f"{where}: expected a tf.Tensor, got {type(t).__name__}") from e
    return t


def native(a: np.ndarray, group: ProcessGroup) -> np.ndarray:
    """A writable contiguous copy of `a` in the group's array module."""
    xp = xp_of(group)
    return np.array(a, copy=True, order="C") if xp is np else xp.asarray(a)


def sub_name(name: Optional[str], part: str) -> Optional[str]:
    """The name of a part of a named collective (one tensor of a group, a gradient)."""
    return None if name is None else f"{name}.{part}"


def upstream(dys: Sequence[Optional[tf.Tensor]], outs: Sequence[tf.Tensor]) -> list:
    """A gradient function's upstream grads: zeros for outputs nothing depends on, each in its
    output's dtype (tf.gradients may pass grad_ys of another float dtype)."""
    return [tf.zeros_like(o) if dy is None else tf.cast(dy, o.dtype) for dy, o in zip(dys, outs)]
