"""horovod.tensorflow.util's helper that Horovod code and tests import."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False while building a graph or a tf.function)."""
    return bool(tf.executing_eagerly())
