"""Keras 3 model.fit on 2 ranks with nccl_ddp.keras against one process on the full batch, on any
backend: imports only keras (the backend is KERAS_BACKEND's), so the TensorFlow checks
(tf_checks.py, in .venv-tf) and the JAX / torch backend tests (main venv) share it."""

from __future__ import annotations

from typing import Optional

import numpy as np

GLOBAL_BATCH, STEPS = 8, 3
LAST: dict = {}  # what the last distributed fit resolved (Keras' jit_compile)
X = np.random.default_rng(7).standard_normal((GLOBAL_BATCH * STEPS, 5))
Y = np.random.default_rng(8).standard_normal((GLOBAL_BATCH * STEPS, 2))


def shard(a: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s part of every global batch, in step order."""
    per = GLOBAL_BATCH // world
    steps = [a[s * GLOBAL_BATCH + rank * per : s * GLOBAL_BATCH + (rank + 1) * per] for s in range(STEPS)]
    return np.concatenate(steps)


def make_model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    )


def fit(
    rank: int,
    world: int,
    distributed: bool,
    clipnorm: Optional[float],
    jit_compile="auto",
    wrap=None,
    **opt_kw,
) -> list:
    """Weights (lists) and the optimizer's iteration count after 2 epochs of Adam(clipnorm) on
    this rank's shard; rank-dependent initial weights, which the callback replaces by rank 0's.
    `opt_kw` go to Adam (gradient_accumulation_steps=2), `wrap` wraps it before we do."""
    import keras

    import nccl_ddp.keras as ndk

    model = make_model(100 + rank)
    opt = keras.optimizers.Adam(learning_rate=0.05, clipnorm=clipnorm, **opt_kw)
    if wrap is not None:  # e.g. LossScaleOptimizer, inside ours
        opt = wrap(opt)
    callbacks = []
    if distributed:
        opt = ndk.DistributedOptimizer(opt)
        callbacks = [ndk.BroadcastGlobalVariablesCallback(0)]
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    if distributed:
        LAST["jit_compile"] = bool(model.jit_compile)
    x, y = shard(X, rank, world), shard(Y, rank, world)
    model.fit(x, y, batch_size=GLOBAL_BATCH // world, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return [np.asarray(w).tolist() for w in model.get_weights()] + [int(np.asarray(opt.iterations))]


def fit_and_reference(rank: int, world: int, jit_compile="auto") -> dict:
    """This rank's distributed fit, then (no collectives) the oracle: one process, whole batches,
    the plain optimizer; and the unclipped oracle (the clip is active in these steps)."""
    import keras

    keras.config.set_floatx("float64")
    return {
        "fit": fit(rank, world, True, 0.05, jit_compile),
        "ref_fit": fit(0, 1, False, 0.05, jit_compile),
        "ref_fit_unclipped": fit(0, 1, False, None, jit_compile),
        "jit_compile": LAST["jit_compile"],
    }
