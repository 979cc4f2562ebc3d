# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
# Modifications copyright 2026 the nccl_ddp authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py on nccl_ddp: the Horovod imports are
replaced by nccl_ddp.horovod. Keras 3 changed two APIs it uses (marked `Keras 3:`): `compile()`
no longer takes `experimental_run_tf_function`, and ModelCheckpoint wants a `.keras` file.
The other changes, marked `nccl_ddp:`, make it a test that runs in seconds on a CPU without a
download: synthetic MNIST-shaped data whose global batches each rank takes its slice of, in order
(no shuffle), a seed, and settings for the dropout rates, learning rate, warm-up, steps and
epochs (dropout masks and the size-dependent warm-up cannot match between 2 ranks and 1), and
--save-params. Run: horovodrun -np 2 python THIS.
"""

# ruff: noqa: E501  (Horovod's code as it is)
import argparse
import sys

import numpy as np
import tensorflow as tf

import nccl_ddp.horovod as horovod  # nccl_ddp: was `import horovod` (horovod.run is not provided)
import nccl_ddp.horovod.tensorflow.keras as hvd  # nccl_ddp: was `import horovod.tensorflow.keras as hvd`

parser = argparse.ArgumentParser()  # nccl_ddp: the settings a CPU test needs
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--dropout", type=float, nargs=2, default=[0.25, 0.5])
parser.add_argument("--base-lr", type=float, default=0.001)
parser.add_argument("--warmup-epochs", type=int, default=3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--save-params", type=str, default="")


def main(args):
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    # nccl_ddp: synthetic MNIST-shaped data instead of the download; global batch k holds
    # rows [k*B*size, (k+1)*B*size) and rank r trains its r-th slice of it
    rng = np.random.default_rng(args.seed)
    steps = args.steps // hvd.size()
    n = steps * args.batch_size * hvd.size()
    mnist_images = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
    mnist_labels = rng.integers(0, 10, n)
    mnist_images = mnist_images.reshape(steps, hvd.size(), args.batch_size, 28, 28)[:, hvd.rank()].reshape(
        -1, 28, 28
    )
    mnist_labels = mnist_labels.reshape(steps, hvd.size(), args.batch_size)[:, hvd.rank()].reshape(-1)

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().batch(args.batch_size)  # nccl_ddp: in order (was .shuffle(10000).batch(128))

    tf.keras.utils.set_random_seed(args.seed)  # nccl_ddp: the same initial model on every rank
    mnist_model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
            tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Dropout(args.dropout[0]),  # nccl_ddp: was 0.25
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dropout(args.dropout[1]),  # nccl_ddp: was 0.5
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = args.base_lr * hvd.size()  # nccl_ddp: was 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(
        loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"]
    )  # Keras 3: experimental_run_tf_function=False is no longer accepted

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1
        ),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0 and args.checkpoint:  # nccl_ddp: --checkpoint
        callbacks.append(tf.keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.keras"))  # Keras 3: was .h5

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    history = mnist_model.fit(
        dataset,
        steps_per_epoch=args.steps // hvd.size(),
        callbacks=callbacks,
        epochs=args.epochs,
        verbose=verbose,
    )
    if args.save_params and hvd.rank() == 0:  # nccl_ddp: what the test compares
        np.savez(args.save_params, *[v.numpy() for v in mnist_model.trainable_variables])
        np.save(args.save_params + ".loss.npy", np.asarray(history.history["loss"]))


if __name__ == "__main__":
    if len(sys.argv) == 4:
        # run training through horovod.run
        np = int(sys.argv[1])
        hosts = sys.argv[2]
        comm = sys.argv[3]
        print("Running training through horovod.run")
        horovod.run(main, np=np, hosts=hosts, use_gloo=comm == "gloo", use_mpi=comm == "mpi")
    else:
        # this is running via horovodrun
        main(parser.parse_args())
