"""Data-parallel training of a small JAX MLP: `jax.grad` on every rank, the grads pytree averaged
by nccl_ddp's DistributedGradReducer (bucketed, DLPack in and out), plain SGD.

    nccl-ddp-run --nproc-per-node 2 examples/train_jax_mlp.py [--steps N] [--save params.npz]

Every rank starts from the same parameters (seed 0) and trains on its own synthetic regression
batch; because the grads are averaged, all ranks end with identical parameters.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import nccl_ddp as nd

SIZES = (8, 32, 32, 4)  # in, hidden, hidden, out
LR = 0.05


def init_params(seed=0):
    """{"layers": [{"w": (in, out), "b": (out,)}, ...]} as float32 JAX arrays."""
    g = np.random.default_rng(seed)
    layers = [
        {
            "w": jnp.asarray(g.standard_normal((i, o), dtype=np.float32) / np.sqrt(i)),
            "b": jnp.zeros((o,), jnp.float32),
        }
        for i, o in zip(SIZES[:-1], SIZES[1:])
    ]
    return {"layers": layers}


def batch(rank, step, n=16):
    """Rank `rank`'s inputs and targets for `step` (the same in every run)."""
    g = np.random.default_rng(1000 * rank + step)
    x = g.standard_normal((n, SIZES[0]), dtype=np.float32)
    y = np.sin(x[:, : SIZES[-1]]) + 0.1 * g.standard_normal((n, SIZES[-1]), dtype=np.float32)
    return x, y


def loss_fn(params, x, y):
    h = x
    layers = params["layers"]
    for layer in layers[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    out = h @ layers[-1]["w"] + layers[-1]["b"]
    return jnp.mean((out - y) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", help="write rank 0's final parameters to this .npz")
    args = parser.parse_args()

    nd.init_process_group()
    rank = nd.get_rank()
    params = init_params()
    reducer = nd.DistributedGradReducer(params, mean=True)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for step in range(args.steps):
        x, y = batch(rank, step)
        loss, grads = grad_fn(params, x, y)
        grads = reducer(grads)  # the mean over ranks, a new pytree
        params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
        print(f"step {step}: local loss {float(loss):.6f}")

    flat = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    print(f"param checksum: {sum(float(np.abs(v).sum()) for v in flat.values()):.9e}")
    if args.save and rank == 0:
        np.savez(args.save, **flat)
    reducer.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
