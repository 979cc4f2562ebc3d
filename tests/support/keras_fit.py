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


# one sample of rank 1's shard in step 1 of each epoch: its fp16 grads overflow at any loss scale
# these fits reach, so one process on the whole batch skips those steps too (2 of 6)
BIG = GLOBAL_BATCH + GLOBAL_BATCH // 2


def fit_mixed_precision(rank: int, world: int, distributed: bool, lso_by: str) -> list:
    """Weights, applied steps and the loss scale after 2 epochs of SGD under `mixed_float16`, one
    sample overflowing on rank 1 only; the LossScaleOptimizer built by `compile` ("compile") or
    by the user around the (distributed) optimizer ("user")."""
    import keras

    import nccl_ddp.keras as ndk

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(100 + rank)
        opt = keras.optimizers.SGD(learning_rate=0.05)
        if distributed:
            opt = ndk.DistributedOptimizer(opt)
        if lso_by == "user":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, loss="mse")
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
        y = Y.copy()
        y[BIG] *= 1e4  # the scaled grads of the output, over 65504 in float16
        callbacks = [ndk.BroadcastGlobalVariablesCallback(0)] if distributed else []
        x, y = shard(X, rank, world), shard(y, rank, world)
        model.fit(
            x, y, batch_size=GLOBAL_BATCH // world, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        )
        weights = [np.asarray(w, dtype=np.float64).tolist() for w in model.get_weights()]
        return weights + [int(np.asarray(lso.iterations)), float(np.asarray(lso.dynamic_scale))]
    finally:
        keras.mixed_precision.set_global_policy("float32")
