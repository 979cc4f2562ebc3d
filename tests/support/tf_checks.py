"""TensorFlow / Keras 3 checks, run by tests/adapters/tensorflow_tests/test_tensorflow_adapter.py
in .venv-tf under `python -m nccl_ddp.launch --nproc-per-node 2 tf_checks.py OUT_DIR`. Each rank writes
OUT_DIR/rank{r}.json: what it saw (values, types, error messages); the test asserts on them.

The oracle is a single process on the full batch, computed by each rank itself after the
distributed runs (no collectives), in float64 so that only the order of additions differs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_fit import (  # noqa: E402
    GLOBAL_BATCH,
    STEPS,
    X,
    Y,
    fit,
    fit_and_reference,
    fit_mixed_precision,
    make_model,
    shard,
)

import nccl_ddp as nd  # noqa: E402
import nccl_ddp.keras as ndk  # noqa: E402


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


# -- the tape and the reducer ------------------------------------------------------------------


def tape_training(rank: int, world: int, graph: bool) -> list:
    """STEPS of SGD on a linear model + tanh, the grads reduced by DistributedGradReducer."""
    w = tf.Variable(np.linspace(-1, 1, 10).reshape(5, 2), name="w")
    b = tf.Variable(np.zeros(2), name="b")
    reducer = nd.DistributedGradReducer([w, b]) if world > 1 else None
    x, y = shard(X, rank, world), shard(Y, rank, world)
    per = GLOBAL_BATCH // world

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.tanh(xb @ w + b) - yb) ** 2)
        grads = tape.gradient(loss, [w, b])
        if reducer is not None:
            grads = reducer(grads)
        w.assign_sub(0.1 * grads[0])
        b.assign_sub(0.1 * grads[1])
        return grads

    run = tf.function(step) if graph else step
    kinds = set()
    for s in range(STEPS):
        grads = run(tf.constant(x[s * per : (s + 1) * per]), tf.constant(y[s * per : (s + 1) * per]))
        kinds |= {type(g).__name__ for g in grads}
    return [w.numpy().tolist(), b.numpy().tolist(), sorted(kinds)]


def bad_inputs(rank: int) -> dict:
    w = tf.Variable(np.zeros((3, 2), np.float32), name="w")
    b = tf.Variable(np.zeros(2, np.float32), name="b")
    reducer = nd.DistributedGradReducer([w, b])
    good = [tf.ones((3, 2)), tf.ones(2)]
    solo = [nd.new_group([r]) for r in range(nd.get_world_size())][rank]
    out = {
        "numpy": error_of(lambda: reducer([np.ones((3, 2), np.float32), np.ones(2, np.float32)])),
        "dtype": error_of(lambda: reducer([tf.ones((3, 2), tf.float64), tf.ones(2)])),
        "shape": error_of(lambda: reducer([tf.ones((2, 3)), tf.ones(2)])),
        "none": error_of(lambda: reducer([None, tf.ones(2)])),
        "mixed_params": error_of(lambda: nd.DistributedGradReducer([w, np.zeros(2, np.float32)])),
        "xla": error_of(lambda: tf.function(lambda g: reducer(g), jit_compile=True)(good)),
        "optimizer_type": error_of(lambda: ndk.DistributedOptimizer("adam")),
        "optimizer_twice": error_of(
            lambda: ndk.DistributedOptimizer(ndk.DistributedOptimizer(keras.optimizers.SGD(0.1)))
        ),
        # on a group of one: a collective refused on one rank of several poisons the group
        "symbolic": error_of(lambda: tf.function(lambda t: nd.all_reduce(t, group=solo))(tf.ones(2))),
        "ddp": error_of(lambda: nd.DistributedDataParallel(keras.Sequential([keras.layers.Dense(2)]))),
    }
    after = reducer(good)  # still works: the same all-reduce on every rank
    out["after"] = [a.numpy().tolist() for a in after]
    return out


@tf.function
def in_graph(t):
    """The documented way to run a functional collective inside tf.function."""
    return tf.numpy_function(lambda a: nd.all_reduce(a), [t], t.dtype, stateful=True)


def bfloat16(rank: int) -> list:
    """tf.bfloat16 (no NumPy DLPack type): a collective and a reducer on a bfloat16 variable."""
    summed = nd.all_reduce(tf.constant([1.5 + rank], tf.bfloat16))
    v = tf.Variable(tf.zeros(2, tf.bfloat16))
    grads = nd.DistributedGradReducer([v])([tf.constant([2.0, 4.0 * rank], tf.bfloat16)])
    return [
        summed.dtype.name,
        summed.numpy().astype(float).tolist(),
        grads[0].dtype.name,
        grads[0].numpy().astype(float).tolist(),
    ]


def collectives(rank: int) -> dict:
    t = tf.constant([1.0, 2.0]) * (rank + 1)
    summed = nd.all_reduce(t)
    v = tf.Variable([float(rank), 10.0 + rank])
    got_v = nd.all_reduce(v, op="max")
    kv = keras.Variable(np.full(3, float(rank) + 5.0))
    got_kv = nd.broadcast(kv, src=1)
    return {
        "tensor": [type(summed).__name__, summed.numpy().tolist(), t.numpy().tolist()],
        "variable": [got_v is v, v.numpy().tolist()],
        "keras_variable": [got_kv is kv, kv.numpy().tolist()],
        "float64_dtype": str(nd.all_reduce(tf.constant([1.0], tf.float64)).dtype.name),
        "in_graph": in_graph(tf.constant([rank + 1.0])).numpy().tolist(),
        "bfloat16": bfloat16(rank),
    }


# -- Keras 3 ------------------------------------------------------------------------------------


def keras_jit_refused() -> str:
    model = make_model(1)
    model.compile(optimizer=ndk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    return error_of(lambda: model.fit(X[:8], Y[:8], batch_size=4, epochs=1, verbose=0))


def main() -> None:
    out_dir = sys.argv[1]
    nd.init_process_group("host")
    rank, world = nd.get_rank(), nd.get_world_size()
    keras.config.set_floatx("float64")
    res = {
        "eager": tape_training(rank, world, graph=False),
        "graph": tape_training(rank, world, graph=True),
        "collectives": collectives(rank),
        "bad": bad_inputs(rank),
        "keras_jit": keras_jit_refused(),
        "callback_class": [
            issubclass(ndk.BroadcastGlobalVariablesCallback, keras.callbacks.Callback),
            ndk.BroadcastGlobalVariablesCallback(1).root_rank,
        ],
    }
    # the oracle: one process, the whole batch, the plain optimizer
    res["ref_tape"] = tape_training(0, 1, graph=False)
    res.update(fit_and_reference(rank, world, jit_compile=False))
    # Keras' own machinery after our reduction: accumulation, and loss scaling (scaled grads reduced)
    accumulate = {"gradient_accumulation_steps": 2}
    res["fit_accumulate"] = fit(rank, world, True, 0.05, False, **accumulate)
    res["ref_fit_accumulate"] = fit(0, 1, False, 0.05, False, **accumulate)
    lso = keras.optimizers.LossScaleOptimizer
    res["fit_loss_scale"] = fit(rank, world, True, 0.05, False, wrap=lso)
    res["ref_fit_loss_scale"] = fit(0, 1, False, 0.05, False, wrap=lso)
    # mixed_float16 with an overflow on rank 1 only: the LossScaleOptimizer around ours agrees
    for by in ("compile", "user"):
        res["mixed_" + by] = [
            fit_mixed_precision(rank, world, True, by),
            fit_mixed_precision(0, 1, False, by),
        ]
    nd.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
