"""How the TensorFlow facade runs a collective on a tensor's values: eagerly by calling it, in a
graph as one stateful `tf.numpy_function` (never pruned), whose failures become Horovod's
`tf.errors` types (failures.py).

Every rank must issue the same collectives in the same order: eagerly that is program order, and
a `tf.function` runs its collectives in program order too (automatic control dependencies). A
TensorFlow 1 graph runs its ops in any order on a few threads, and a host function blocks its
thread until every rank has reached its collective, so two ranks that reached different ones
first could wait on each other for good (Horovod's kernels are asynchronous; ours cannot be):
there each collective depends on the one built before it in the graph, so a `Session.run` runs
them in the order they were built, on every rank (Horovod's `test_horovod_allreduce_cpu_fused`;
fetching a later one runs the earlier ones again). A collective fed from a placeholder stays out
of that chain (else every later one would need the feed): run it on its own.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from nccl_ddp.horovod.tensorflow.failures import as_tf_error, gate, guarded


def on_host(
    fn: Callable[[Sequence[np.ndarray]], List[np.ndarray]],
    tensors: Sequence[tf.Tensor],
    dtypes: Sequence[tf.DType],
    op_name: str,
    name: Optional[str],
) -> List[tf.Tensor]:
    """`fn(arrays)` on the tensors' values; returns its outputs as tensors of `dtypes`. In a
    graph the op is named `name` (else `op_name`)."""
    if tf.executing_eagerly():
        try:
            outs = fn([np.asarray(t) for t in tensors])
        except Exception as e:
            err = as_tf_error(e)
            if err is e:
                raise
            raise err from e
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, dtypes)]

    def in_graph(*arrays: np.ndarray) -> List[np.ndarray]:
        return fn(list(arrays))

    graph = tf.compat.v1.get_default_graph()
    chained = not graph.building_function and not _fed(tensors)
    last = _last.get(graph)
    before = [last] if chained and last is not None else []
    with tf.control_dependencies(before):
        results = tf.numpy_function(
            guarded(in_graph, dtypes),
            list(tensors),
            [*dtypes, tf.int32, tf.string],
            stateful=True,
            name=name or op_name,
        )
    if chained:
        _last[graph] = results[0].op
    return gate(results[:-2], results[-2], results[-1], f"{op_name} ({results[0].op.name!r})")


def _fed(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether the tensors depend on a placeholder that a Session.run must feed."""
    seen, todo = set(), [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op.type == "Placeholder":
            return True
        for o in [*(i.op for i in op.inputs), *op.control_inputs]:
            if o.name not in seen:
                seen.add(o.name)
                todo.append(o)
    return False


_last: weakref.WeakKeyDictionary[tf.Graph, tf.Operation] = weakref.WeakKeyDictionary()
"""The collective each TensorFlow 1 graph built last (the next one built depends on it)."""
