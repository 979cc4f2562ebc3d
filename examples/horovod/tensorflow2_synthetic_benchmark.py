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
"""Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py on nccl_ddp: the Horovod import
is replaced by nccl_ddp.horovod.tensorflow. Keras 3 changed one API it uses: `opt.variables()` is
now the attribute `opt.variables` (marked `Keras 3:`). The other changes, marked `nccl_ddp:`, make
it a test that runs in seconds on a CPU: a tiny model option, a configurable image size and
learning rate, a seeded model and a seeded global batch of which each rank trains its slice, and
--save-params. Run: horovodrun -np 2 python THIS --no-cuda --model tiny.
"""

# ruff: noqa: E501, UP031  (Horovod's code as it is)
import argparse
import os
import timeit

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import nccl_ddp.horovod.tensorflow as hvd  # nccl_ddp: was `import horovod.tensorflow as hvd`

parser = argparse.ArgumentParser(
    description="TensorFlow Synthetic Benchmark", formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce"
)
parser.add_argument("--model", type=str, default="ResNet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument(
    "--num-warmup-batches",
    type=int,
    default=10,
    help="number of warm-up batches that don't count towards benchmark",
)
parser.add_argument(
    "--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration"
)
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--image-size", type=int, default=224, help="nccl_ddp: image height and width")
parser.add_argument("--seed", type=int, default=0, help="nccl_ddp: seed of the model and the data")
parser.add_argument("--lr", type=float, default=0.01, help="nccl_ddp: the learning rate")
parser.add_argument(
    "--save-params", type=str, default="", help="nccl_ddp: rank 0 saves the weights here (.npz)"
)

args = parser.parse_args()
args.cuda = not args.no_cuda

hvd.init()

if args.cuda:
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

tf.keras.utils.set_random_seed(args.seed)  # nccl_ddp: the same initial model on every rank
if args.model == "tiny":  # nccl_ddp: a model small enough for a CPU test
    model = tf.keras.Sequential(
        [
            tf.keras.Input((args.image_size, args.image_size, 3)),
            tf.keras.layers.Conv2D(4, 3, activation="relu"),
            tf.keras.layers.GlobalAveragePooling2D(),
            tf.keras.layers.Dense(1000, activation="softmax"),
        ]
    )
else:
    model = getattr(applications, args.model)(weights=None)
opt = tf.optimizers.SGD(args.lr)

# nccl_ddp: one seeded global batch; this rank trains its slice
n = args.batch_size * hvd.size()
mine = slice(hvd.rank() * args.batch_size, (hvd.rank() + 1) * args.batch_size)
data = tf.random.stateless_uniform([n, args.image_size, args.image_size, 3], seed=[args.seed, 1])[mine]
target = tf.random.stateless_uniform([n, 1], seed=[args.seed, 2], minval=0, maxval=999, dtype=tf.int64)[mine]


@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: was opt.variables()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log("Model: %s" % args.model)
log("Batch size: %d" % args.batch_size)
device = "GPU" if args.cuda else "CPU"
log("Number of %ss: %d" % (device, hvd.size()))


with tf.device(device):
    # Warm-up
    log("Running warmup...")
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

    # Benchmark
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log("Iter #%d: %.1f img/sec per %s" % (x, img_sec, device))
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log("Img/sec per %s: %.1f +-%.1f" % (device, img_sec_mean, img_sec_conf))
    log(
        "Total img/sec on %d %s(s): %.1f +-%.1f"
        % (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf)
    )
if args.save_params and hvd.rank() == 0:  # nccl_ddp: what the test compares
    np.savez(args.save_params, *[v.numpy() for v in model.trainable_variables])
