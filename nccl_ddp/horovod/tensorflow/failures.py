"""How a collective's failure reaches TensorFlow code: as the `tf.errors` types Horovod raises
(ranks that disagree: `FailedPreconditionError`; bad arguments: `InvalidArgumentError`), which are
also our own `RankMismatchError` / `ConfigError`, so either `except` catches them.

Eagerly the exception is raised as such. In a graph, TensorFlow turns any Python exception of a
`numpy_function` into `UnknownError` (or `InvalidArgumentError` for ValueError), so there the host
function returns a status and a message beside its outputs, and `gate` raises from the graph: an
`Assert` (InvalidArgumentError, with the message) or a read of a variable that does not exist
(FailedPreconditionError: no TensorFlow op raises it with a message computed at run time, so its
name says what failed and the ranks' shapes are printed on stderr first).
"""

from __future__ import annotations

import sys
from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

from nccl_ddp.errors import ConfigError, ConfigTypeError, RankMismatchError

OK, MISMATCH, INVALID = 0, 1, 2


class HorovodMismatchError(RankMismatchError, tf.errors.FailedPreconditionError):
    """Ranks passed different shapes, dtypes, root ranks or names to one collective."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class HorovodArgumentError(ConfigError, tf.errors.InvalidArgumentError):
    """An argument of a collective that no rank could run it with (e.g. splits not summing up)."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)


def as_tf_error(e: Exception) -> Exception:
    """`e` as the `tf.errors` type Horovod raises for it (itself when there is none)."""
    if isinstance(e, tf.errors.OpError):
        return e
    if isinstance(e, RankMismatchError):
        return HorovodMismatchError(str(e))
    if isinstance(e, (ConfigError, ConfigTypeError)):
        return HorovodArgumentError(str(e))
    return e


def guarded(fn: Callable[..., List[np.ndarray]], dtypes: Sequence[tf.DType]) -> Callable[..., list]:
    """`fn` for a graph's numpy_function: its outputs, then a status and a message; on a failure
    Horovod has a `tf.errors` type for, empty outputs and that status instead of an exception."""

    def run(*arrays: np.ndarray) -> list:
        try:
            return [*fn(*arrays), np.int32(OK), np.bytes_(b"")]
        except Exception as e:  # noqa: BLE001  (sorted below; the others propagate)
            err = as_tf_error(e)
            if err is e:
                raise
            code = MISMATCH if isinstance(err, tf.errors.FailedPreconditionError) else INVALID
            empty = [np.zeros(0, d.as_numpy_dtype) for d in dtypes]
            return [*empty, np.int32(code), np.bytes_(str(err).encode())]

    return run


def gate(outs: Sequence[tf.Tensor], code: tf.Tensor, message: tf.Tensor, where: str) -> List[tf.Tensor]:
    """`outs`, available only once `code` says the host function succeeded; else the step fails
    with the error's `tf.errors` type."""

    def mismatch() -> tf.Tensor:
        with tf.control_dependencies([tf.print(message, output_stream=sys.stderr)]):
            handle = tf.raw_ops.VarHandleOp(
                dtype=tf.int32,
                shape=[],
                container="horovod",
                shared_name=f"{where}: the ranks disagree on the tensors' shapes, dtypes or root "
                "rank (each rank's are printed above)",
            )
            return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)

    checked = tf.cond(tf.equal(code, MISMATCH), mismatch, lambda: tf.constant(0, tf.int32))
    valid = tf.debugging.Assert(tf.not_equal(code, INVALID), [message], name="horovod_invalid_argument")
    with tf.control_dependencies([checked, valid]):
        return [tf.identity(o) for o in outs]
