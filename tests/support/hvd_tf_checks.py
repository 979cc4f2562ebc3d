"""Run under `horovodrun -np 2` in .venv-tf by tests/horovod/test_hvd_tensorflow.py: Horovod's
TensorFlow/Keras API (nccl_ddp.horovod.tensorflow[.keras]) on 2 ranks. Each rank writes
OUT/rank{r}.json: collective results (eager and inside tf.function), DistributedGradientTape
against one process on the full batch, the Keras callbacks' effects, bad inputs' messages, and
the Horovod semantics of hvd_tf_semantics.py."""

import json
import os
import sys

import numpy as np
import tensorflow as tf
from hvd_tf_semantics import semantics

import nccl_ddp.horovod.tensorflow as hvd
import nccl_ddp.horovod.tensorflow.keras as hvdk


def err(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def tolist(t):
    return np.asarray(t).tolist()


def collectives(rank):
    t = tf.constant([1.0, 2.0, 3.0]) * (rank + 1)
    out = {
        "average": tolist(hvd.allreduce(t)),
        "sum": tolist(hvd.allreduce(t, op=hvd.Sum)),
        "max": tolist(hvd.allreduce(t, op=hvd.Max)),
        "scaled": tolist(hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)),
        "fp16": [
            hvd.allreduce(t, compression=hvd.Compression.fp16).dtype.name,
            tolist(hvd.allreduce(t / 3, compression=hvd.Compression.fp16)),
        ],
        "grouped": [
            tolist(x) for x in hvd.grouped_allreduce([t, tf.ones([2], tf.float64) * (rank + 1)], op=hvd.Sum)
        ],
        "allgather": tolist(hvd.allgather(tf.fill([rank + 1, 2], float(rank)))),
        "broadcast": tolist(hvd.broadcast(t, root_rank=1)),
        "reducescatter": tolist(
            hvd.reducescatter(tf.reshape(tf.range(10.0), [5, 2]) * (rank + 1), op=hvd.Sum)
        ),
        "alltoall": [
            tolist(x) for x in hvd.alltoall(tf.range(3.0) + 10 * rank, splits=[1, 2] if rank == 0 else [2, 1])
        ],
        "object": hvd.broadcast_object({"r": rank}, root_rank=1),
        "objects": hvd.allgather_object(rank),
    }
    v = tf.Variable([float(rank), 5.0])
    hvd.broadcast_variables([v], root_rank=1)
    out["variable"] = tolist(v)

    @tf.function
    def in_graph(x):
        return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, root_rank=0)

    out["graph"] = [tolist(a) for a in in_graph(t)]
    out["adasum"] = err(lambda: hvd.allreduce(t, op=hvd.Adasum))
    out["unknown_op"] = err(lambda: hvd.allreduce(t, op=9))
    out["mismatch"] = err(lambda: hvd.allgather(tf.ones([2, 2 + rank])))
    out["tape_op"] = err(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Max))
    out["keras_passes"] = err(
        lambda: hvdk.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2
        )
    )
    out["v1_optimizer"] = err(lambda: hvd.DistributedOptimizer(object()))
    return out


def tape_training(rank, size, graph, fp16=False):
    """3 SGD steps of a linear model, grads from DistributedGradientTape on this rank's half
    (float64; float32 with fp16 compression, which casts float32 grads)."""
    rng = np.random.default_rng(0)
    dtype = np.float32 if fp16 else np.float64
    x, y = rng.normal(size=(16, 4)).astype(dtype), rng.normal(size=(16, 2)).astype(dtype)
    w0 = rng.normal(size=(4, 2)).astype(dtype)

    def train(xs, ys, distributed, compress=fp16):
        w = tf.Variable(w0)
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((xs @ w - ys) ** 2)
            if distributed:
                comp = hvd.Compression.fp16 if compress else hvd.Compression.none
                tape = hvd.DistributedGradientTape(tape, compression=comp)
            (g,) = tape.gradient(loss, [w])
            opt.apply_gradients([(g, w)])

        run = tf.function(step) if graph else step
        for _ in range(3):
            run()
        return w.numpy()

    ref = train(x, y, False)
    mine = slice(rank * 8, rank * 8 + 8)
    ours = train(x[mine], y[mine], True)
    if fp16:  # the same run without compression differs: the fp16 wire was used
        plain = train(x[mine], y[mine], True, False)
        return float(np.abs(ours - ref).max()), ours.tolist(), float(np.abs(plain - ours).max())
    return float(np.abs(ours - ref).max()), ours.tolist()


def callbacks(rank, size):
    """The LR callbacks' rates per batch, and MetricAverageCallback's logs."""
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.04, momentum=0.5))
    model.compile(optimizer=opt, loss="mse")
    rates = []

    class Record(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            rates.append(float(np.asarray(self.model.optimizer.learning_rate)))

    x = np.ones((8, 2), np.float32) * (rank + 1)
    y = np.ones((8, 1), np.float32)
    avg = hvdk.callbacks.MetricAverageCallback()
    warm = hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.04, warmup_epochs=2, verbose=0)
    hist = model.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0), avg, warm, Record()],
    )
    sched = hvdk.callbacks.LearningRateScheduleCallback(initial_lr=0.04, multiplier=0.5, start_epoch=1)
    rates2 = []

    class Record2(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            rates2.append(float(np.asarray(self.model.optimizer.learning_rate)))

    model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False, callbacks=[sched, Record2()])
    return {
        "warmup_rates": rates,
        "schedule_rates": rates2,
        "loss": hist.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
    }


def main():
    out_dir = sys.argv[1]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    res = {"ids": [rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]}
    res["collectives"] = collectives(rank)
    res["tape_eager"] = tape_training(rank, size, graph=False)
    res["tape_graph"] = tape_training(rank, size, graph=True)
    res["tape_fp16"] = tape_training(rank, size, graph=True, fp16=True)
    res["callbacks"] = callbacks(rank, size)
    res["semantics"] = semantics(rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
