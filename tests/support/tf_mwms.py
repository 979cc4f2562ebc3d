"""TensorFlow's own data parallelism as the oracle: tf_keras (Keras 2) model.fit under
tf.distribute.MultiWorkerMirroredStrategy, and nccl_ddp.keras's Keras 3 model.fit, on the same 2
ranks, data shards and initial weights. Run by
tests/adapters/tensorflow_tests/test_tensorflow_adapter.py in .venv-tf under
`python -m nccl_ddp.launch --nproc-per-node 2 tf_mwms.py OUT_DIR`; each rank writes
OUT_DIR/mwms{r}.json with both models' weights."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
RANK, WORLD, PORT = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
# MultiWorkerMirroredStrategy must exist before any other TensorFlow op; its gRPC ports sit
# next to the launcher's
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": [f"127.0.0.1:{PORT + 10 + i}" for i in range(WORLD)]},
        "task": {"type": "worker", "index": RANK},
    }
)
import tensorflow as tf  # noqa: E402

STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import tf_keras  # noqa: E402
from keras_fit import GLOBAL_BATCH, STEPS, X, Y, fit, make_model, shard  # noqa: E402

import nccl_ddp as nd  # noqa: E402


def mwms_fit(initial: list, clipnorm) -> list:
    """tf_keras under MWMS: every worker fits its own shard (distribute_datasets_from_function),
    per-replica batch GLOBAL_BATCH / WORLD, so each step's global batch is ours."""
    with STRATEGY.scope():
        model = tf_keras.Sequential(
            [tf_keras.Input((5,)), tf_keras.layers.Dense(4, activation="tanh"), tf_keras.layers.Dense(2)]
        )
        model.set_weights(initial)
        model.compile(optimizer=tf_keras.optimizers.Adam(learning_rate=0.05, clipnorm=clipnorm), loss="mse")

    def shard_of_worker(context: tf.distribute.InputContext) -> tf.data.Dataset:
        data = tf.data.Dataset.from_tensor_slices((shard(X, RANK, WORLD), shard(Y, RANK, WORLD)))
        return data.batch(context.get_per_replica_batch_size(GLOBAL_BATCH)).repeat()

    data = STRATEGY.distribute_datasets_from_function(shard_of_worker)
    model.fit(data, epochs=2, steps_per_epoch=STEPS, verbose=0)
    return [w.tolist() for w in model.get_weights()]


def main() -> None:
    keras.config.set_floatx("float64")
    tf_keras.backend.set_floatx("float64")
    initial = make_model(100).get_weights()  # rank 0's initial weights in the Keras 3 runs
    res = {"mwms": mwms_fit(initial, 0.05), "mwms_unclipped": mwms_fit(initial, None)}
    nd.init_process_group("host")
    res["ours"] = fit(RANK, WORLD, True, 0.05)[:-1]
    res["ours_unclipped"] = fit(RANK, WORLD, True, None)[:-1]
    nd.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"mwms{RANK}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
