"""Data-parallel Keras 3 `model.fit` with one changed line (the optimizer) and one callback, on
any Keras 3 backend (TensorFlow, JAX or torch: set KERAS_BACKEND).

    .venv-tf/bin/nccl-ddp-run --nproc-per-node 2 examples/keras_fit.py [--epochs N]

Each rank fits its own half of every global batch of a synthetic regression set; the grads are
averaged in the optimizer's apply() (before Keras clips them), and every rank starts from rank 0's
weights, so all ranks end with identical weights, the ones one process gets on the whole batches.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import nccl_ddp as nd  # noqa: E402
import nccl_ddp.keras as ndk  # noqa: E402

GLOBAL_BATCH = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()

    nd.init_process_group()
    rank, world = nd.get_rank(), nd.get_world_size()
    g = np.random.default_rng(0)
    x = g.standard_normal((GLOBAL_BATCH * 16, 8)).astype(np.float32)
    y = np.sin(x[:, :2]) + 0.1 * g.standard_normal((len(x), 2)).astype(np.float32)
    per = GLOBAL_BATCH // world  # this rank's part of each global batch
    mine = np.concatenate([np.arange(s, s + per) + rank * per for s in range(0, len(x), GLOBAL_BATCH)])

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer=ndk.DistributedOptimizer(keras.optimizers.Adam(1e-2, clipnorm=1.0)),  # the one line
        loss="mse",
        jit_compile=False,  # XLA cannot call back into Python, where nccl_ddp all-reduces
    )
    history = model.fit(
        x[mine],
        y[mine],
        batch_size=per,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[ndk.BroadcastGlobalVariablesCallback(0)],  # rank 0's initial weights
    )
    checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
    print(f"rank {rank}: loss {history.history['loss'][-1]:.4f}, weight checksum {checksum:.6f}")
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
