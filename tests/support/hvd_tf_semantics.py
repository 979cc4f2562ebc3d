"""Horovod's TensorFlow semantics that its own test suite checks, on 2 ranks (called from
hvd_tf_checks.py's job): the ops for the ranks, tf.uint16, eager broadcast_'s result, tf.errors
types with the group usable after, TensorFlow 1 graphs (collectives fetched together, symbolic
alltoall splits, broadcast_global_variables), every collective's gradient, IndexedSlices, local
sources and the Keras extras (local variables, partial optimizer, backward_passes_per_step)."""

import numpy as np
import tensorflow as tf

import nccl_ddp.horovod.tensorflow as hvd
import nccl_ddp.horovod.tensorflow.keras as hvdk
from nccl_ddp.errors import RankMismatchError


def kind(fn):
    """The exception classes `fn` raises that Horovod's tests catch, or 'ok'."""
    try:
        fn()
    except Exception as e:
        names = [c.__name__ for c in type(e).__mro__]
        return [n for n in ("FailedPreconditionError", "InvalidArgumentError", "RankMismatchError",
                            "NotImplementedError", "RuntimeError") if n in names]  # fmt: skip
    return "ok"


def basics(rank):
    v = tf.Variable([float(rank)] * 3)
    (assigned,) = hvd.broadcast_([v], root_rank=1)
    u16 = tf.constant([rank, 60000], tf.uint16)
    return {
        "ops": [int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_rank_op()), int(hvd.local_size_op())],
        "ccl": hvd.ccl_built(),
        "eagerly": hvd._executing_eagerly() and hvd.util._executing_eagerly(),
        "broadcast_": [np.asarray(assigned).tolist(), v.numpy().tolist()],
        "uint16": [
            hvd.allgather(u16).numpy().tolist(),
            hvd.broadcast(u16, root_rank=1).numpy().tolist(),
            hvd.alltoall(u16).numpy().tolist(),
            hvd.allgather(u16).dtype.name,
        ],
        "grouped_allgather": [t.numpy().tolist() for t in hvd.grouped_allgather([u16, tf.ones([rank + 1])])],
        "grouped_reducescatter": [
            t.numpy().tolist() for t in hvd.grouped_reducescatter([tf.ones([4, 1]) * (rank + 1)], op=hvd.Sum)
        ],
    }


def errors(rank):
    out = {
        "shape": kind(lambda: hvd.allreduce(tf.ones([2 + rank]))),
        "rank_of_tensor": kind(lambda: hvd.reducescatter(tf.ones([6]) if rank else tf.ones([2, 3]))),
        "dtype": kind(lambda: hvd.broadcast(tf.ones([2], tf.float32 if rank else tf.int32), 0)),
        "root": kind(lambda: hvd.broadcast(tf.ones([2]), root_rank=rank)),
        "gather_shape": kind(lambda: hvd.allgather(tf.ones([2, 2 + rank]))),
        "alltoall_dtype": kind(lambda: hvd.alltoall(tf.ones([2], tf.float32 if rank else tf.int32))),
        "splits": kind(lambda: hvd.alltoall(tf.ones([3]))),
        "sparse_min": kind(lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), [0]), op=hvd.Min)),
        "sparse_scaled": kind(
            lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), [0]), op=hvd.Sum, prescale_factor=2.0)
        ),
        "eager_global_variables": kind(lambda: hvd.broadcast_global_variables(0)),
    }
    out["usable_after"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist()
    out["also_ours"] = issubclass(
        type(_caught(lambda: hvd.allreduce(tf.ones([1 + rank])))), RankMismatchError
    )
    return out


def _caught(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


def graph_mode(rank):
    """A TensorFlow 1 graph: one Session.run fetches 8 collectives (its threads may reach them
    in any order), a mismatch, symbolic splits, broadcast_global_variables."""
    out = {}
    with tf.Graph().as_default():
        sums = [hvd.allreduce(tf.ones([3]) * (i + rank), op=hvd.Sum) for i in range(8)]
        bad = hvd.allreduce(tf.ones([2 + rank]))
        splits = tf.compat.v1.placeholder(tf.int32, [2])
        moved, received = hvd.alltoall(tf.range(3) + 10 * rank, splits=splits)
        v = tf.compat.v1.Variable([float(rank)] * 2)
        bcast = hvd.broadcast_global_variables(1)
        x = tf.constant([1.0, 2.0]) * (rank + 1)
        grad = tf.gradients(hvd.allreduce(x, op=hvd.Sum), x)[0]
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            out["fused"] = [r.tolist() for r in s.run(sums)]
            out["mismatch"] = kind(lambda: s.run(bad))
            out["alltoall"] = [
                a.tolist() for a in s.run([moved, received], {splits: [1, 2] if rank == 0 else [2, 1]})
            ]
            s.run(bcast)
            out["global_variables"] = s.run(v).tolist()
            out["grad"] = s.run(grad).tolist()

    @tf.function
    def symbolic(t, sp):
        return hvd.alltoall(t, splits=sp)

    got = symbolic(tf.range(3) + 10 * rank, tf.constant([1, 2] if rank == 0 else [2, 1]))
    out["tf_function_alltoall"] = [g.numpy().tolist() for g in got]
    return out


def gradients(rank):
    """Each collective's gradient of sum(output * w) with w = 1..n (eager tape)."""
    out = {}
    x = tf.Variable([1.0, 2.0, 3.0, 4.0]) * 1.0
    cases = {
        "allreduce_sum": lambda t: hvd.allreduce(t, op=hvd.Sum),
        "allreduce_avg": lambda t: hvd.allreduce(t),
        "grouped_allreduce": lambda t: hvd.grouped_allreduce([t], op=hvd.Sum)[0],
        "allgather": lambda t: hvd.allgather(t[: rank + 1]),
        "grouped_allgather": lambda t: hvd.grouped_allgather([t[: rank + 1]])[0],
        "broadcast": lambda t: hvd.broadcast(t, root_rank=1),
        "alltoall": lambda t: hvd.alltoall(t, splits=[1, 3] if rank == 0 else [2, 2])[0],
        "reducescatter_sum": lambda t: hvd.reducescatter(t, op=hvd.Sum),
        "grouped_reducescatter": lambda t: hvd.grouped_reducescatter([t], op=hvd.Sum)[0],
    }
    for name, fn in cases.items():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * tf.range(1.0, 1.0 + tf.cast(tf.size(y), tf.float32)))
        out[name] = tape.gradient(loss, x).numpy().tolist()
    return out


def sparse(rank):
    s = tf.IndexedSlices(tf.ones([1, 2]) * (rank + 1), tf.constant([rank]), tf.constant([2, 2]))
    summed, averaged = hvd.allreduce(s, op=hvd.Sum), hvd.allreduce(s, op=hvd.Average)
    emb = tf.Variable(tf.ones([3, 2]))
    out = {
        "sum": [summed.values.numpy().tolist(), summed.indices.numpy().tolist()],
        "average": averaged.values.numpy().tolist(),
    }
    for as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [rank]) * (rank + 1))
        (g,) = hvd.DistributedGradientTape(tape, sparse_as_dense=as_dense).gradient(loss, [emb])
        out[f"tape_dense_{as_dense}"] = [type(g).__name__, tf.convert_to_tensor(g).numpy().tolist()]
    return out


def local_sources(rank):
    """PartialDistributedGradientTape / register_local_source, PartialDistributedOptimizer."""
    import keras

    layer, shared = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
    model = keras.Sequential([keras.Input((1,)), layer, shared])
    for w in model.weights:
        w.assign(tf.ones(w.shape))
    x = tf.constant([[float(rank + 1)]])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x))
    plain = [g.numpy().tolist() for g in tape.gradient(loss, model.trainable_weights)]
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[layer])
    reduced = [g.numpy().tolist() for g in partial.gradient(loss, model.trainable_weights)]
    local, shared_pairs = partial.get_local_and_global_gradients(loss, model.trainable_weights)
    opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[layer])
    pairs = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    return {
        "plain": plain,
        "tape": reduced,
        "split": [len(local), len(shared_pairs)],
        "optimizer": [g.numpy().tolist() for g, _ in pairs],
    }


def keras_extras(rank):
    """BroadcastGlobalVariablesCallback(local_variables=), backward_passes_per_step."""
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1), keras.layers.Dense(1)])
    for w in model.weights:
        w.assign(tf.fill(w.shape, float(rank)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    local = list(model.layers[0].weights)
    cb = hvdk.callbacks.BroadcastGlobalVariablesCallback(root_rank=1, local_variables=local)
    model.fit(np.ones((2, 1)), np.ones((2, 1)), epochs=1, verbose=0, callbacks=[cb])
    out = {"callback": [w.numpy().ravel().tolist() for w in model.weights]}
    for average in (False, True):
        v = tf.Variable([0.0])
        opt = hvdk.DistributedOptimizer(
            keras.optimizers.SGD(1.0), backward_passes_per_step=2, average_aggregated_gradients=average
        )
        seen = []
        for step in range(4):
            g = tf.constant([float(rank + 1 + step)])  # mean over the ranks: 1.5 + step
            opt.apply_gradients([(g, v)], experimental_aggregate_gradients=False)
            seen.append([float(v.numpy()[0]), int(opt._agg_helper.counter.numpy())])
        out[f"passes_average_{average}"] = seen
    return out


def semantics(rank):
    return {
        "basics": basics(rank),
        "errors": errors(rank),
        "graph": graph_mode(rank),
        "gradients": gradients(rank),
        "sparse": sparse(rank),
        "local": local_sources(rank),
        "keras": keras_extras(rank),
    }
