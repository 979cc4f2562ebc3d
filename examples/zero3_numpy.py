"""ZeRO-3 for NumPy: a two-layer MLP whose parameters, grads and AdamW state are sharded across
the ranks (`nd.ShardedParams`, one unit per layer). The forward gathers layer after layer
(`gather_unit` prefetches the next layer while this one computes); backprop is written out by
hand; `step` averages the grads into the shards and runs the fused AdamW on them.

    nccl-ddp-run --nproc-per-node 2 examples/zero3_numpy.py [--steps N]

Each rank trains on batches of its own; every rank ends with the same parameters (each prints
their checksum).
"""

import argparse

import numpy as np

import nccl_ddp as nd

SIZES = (8, 64, 4)  # in, hidden, out (64 and 4 rows are cut along dim 0 across the ranks)


def init_params(seed=0):
    g = np.random.default_rng(seed)
    return {
        "w1": (g.standard_normal((SIZES[1], SIZES[0])) / np.sqrt(SIZES[0])).astype(np.float32),
        "b1": np.zeros(SIZES[1], np.float32),
        "w2": (g.standard_normal((SIZES[2], SIZES[1])) / np.sqrt(SIZES[1])).astype(np.float32),
        "b2": np.zeros(SIZES[2], np.float32),
    }


def batch(rank, step, n=32):
    g = np.random.default_rng([rank, step])
    x = g.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, np.sin(x[:, : SIZES[2]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    nd.init_process_group()
    rank = nd.get_rank()
    sp = nd.ShardedParams(init_params(), nd.ShardAdamW(lr=1e-2), units=[["w1", "b1"], ["w2", "b2"]])
    for step in range(args.steps):
        x, y = batch(rank, step)
        w1, b1 = sp.gather_unit(0)  # starts the gather of layer 2 too
        h = np.tanh(x @ w1.T + b1)
        w2, b2 = sp.gather_unit(1)
        out = h @ w2.T + b2
        loss = float(np.mean((out - y) ** 2))
        d = 2 * (out - y) / out.size  # backprop of the mean squared error
        dh = (d @ w2) * (1 - h**2)
        sp.step({"w1": dh.T @ x, "b1": dh.sum(0), "w2": d.T @ h, "b2": d.sum(0)})
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss:.6f}", flush=True)
    params = sp.gather()
    checksum = sum(float(np.sum(v.astype(np.float64))) for v in params.values())
    print(f"rank {rank}: param checksum {checksum:.10f}; shard bytes {sp.shard_nbytes}", flush=True)
    sp.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
