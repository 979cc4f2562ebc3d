"""ZeRO-3 for Paddle: a small network's parameters, grads and AdamW state sharded across the
ranks (`nd.ShardedParams` over Paddle tensors, one unit per layer). Each step gathers the
parameters layer by layer (`gather_unit` prefetches the next layer while this one computes) as
Paddle tensors, runs the forward functionally on them and Paddle's backward, and `step`
averages the grads into the shards and runs the fused AdamW on them.

    nccl-ddp-run --nproc-per-node 2 examples/zero3_paddle.py [--steps N]
    (in the Paddle venv: .venv-paddle/bin/python -m nccl_ddp.launch --nproc-per-node 2 ...)

Each rank trains on batches of its own; every rank ends with the same parameters (each prints
their checksum).
"""

import argparse
import warnings

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found")  # Paddle's, at import without ccache
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

import nccl_ddp as nd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    nd.init_process_group()
    rank = nd.get_rank()
    paddle.seed(2026 + rank)  # a different initial network per rank: rank 0's is broadcast
    net = paddle.nn.Sequential(paddle.nn.Linear(10, 32), paddle.nn.Tanh(), paddle.nn.Linear(32, 1))
    params = net.parameters()  # [w1 (10, 32), b1, w2 (32, 1), b2]: Paddle's names, every rank's
    sp = nd.ShardedParams(params, nd.ShardAdamW(lr=1e-2), units=[[0, 1], [2, 3]])
    del net, params  # from here on a rank keeps its shards only
    for step in range(args.steps):
        g = np.random.default_rng([rank, step])
        x = paddle.to_tensor(g.standard_normal((16, 10)).astype(np.float32))
        y = paddle.sin(x[:, :1])
        layer1 = sp.gather_unit(0)  # starts the gather of layer 2 too
        for t in layer1:
            t.stop_gradient = False
        h = paddle.tanh(F.linear(x, *layer1))
        layer2 = sp.gather_unit(1)
        for t in layer2:
            t.stop_gradient = False
        loss = F.mse_loss(F.linear(h, *layer2), y)
        loss.backward()
        sp.step([t.grad for t in layer1 + layer2])
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {float(loss):.6f}", flush=True)
    checksum = sum(float(t.numpy().astype(np.float64).sum()) for t in sp.gather())
    print(f"rank {rank}: param checksum {checksum:.10f}; shard bytes {sp.shard_nbytes}", flush=True)
    sp.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
