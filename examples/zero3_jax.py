"""ZeRO-3 for JAX: an MLP's parameters, grads and AdamW state sharded across the ranks
(`nd.ShardedParams` over the parameters' pytree, one unit per layer). Each step gathers the
pytree whole (jax.Arrays), takes `jax.grad` of the loss on this rank's batch, and `step`
averages the grads into the shards and runs the fused AdamW on them.

    nccl-ddp-run --nproc-per-node 2 examples/zero3_jax.py [--steps N]

Each rank trains on batches of its own; every rank ends with the same parameters (each prints
their checksum).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import nccl_ddp as nd

SIZES = (8, 64, 64, 4)


def init_params(seed=0):
    g = np.random.default_rng(seed)
    return {
        "layers": [
            {"w": jnp.asarray(g.standard_normal((o, i)) / np.sqrt(i), jnp.float32), "b": jnp.zeros(o)}
            for i, o in zip(SIZES[:-1], SIZES[1:])
        ]
    }


def loss_fn(params, x, y):
    h = x
    for layer in params["layers"][:-1]:
        h = jnp.tanh(h @ layer["w"].T + layer["b"])
    out = h @ params["layers"][-1]["w"].T + params["layers"][-1]["b"]
    return jnp.mean((out - y) ** 2)


def batch(rank, step, n=32):
    g = np.random.default_rng([rank, step])
    x = g.standard_normal((n, SIZES[0])).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x[:, : SIZES[-1]]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    nd.init_process_group()
    rank = nd.get_rank()
    units = [[f"['layers'][{k}]['b']", f"['layers'][{k}]['w']"] for k in range(len(SIZES) - 1)]
    sp = nd.ShardedParams(init_params(), nd.ShardAdamW(lr=1e-2), units=units)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for step in range(args.steps):
        params = sp.gather()  # the whole pytree, gathered unit after unit
        loss, grads = grad_fn(params, *batch(rank, step))
        del params  # only the shards stay between steps
        sp.step(grads)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {float(loss):.6f}", flush=True)
    leaves = jax.tree_util.tree_leaves(sp.gather())
    checksum = sum(float(np.sum(np.asarray(x, np.float64))) for x in leaves)
    print(f"rank {rank}: param checksum {checksum:.10f}; shard bytes {sp.shard_nbytes}", flush=True)
    sp.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
