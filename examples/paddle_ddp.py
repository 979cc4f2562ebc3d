"""The example of `paddle.DataParallel`'s documentation (LinearNet, MSELoss, Adam) on nccl_ddp: two
lines changed, `nd.init_process_group()` for `dist.init_parallel_env()` and
`nd.DistributedDataParallel(layer)` for `paddle.DataParallel(layer)`. A few steps on random data of
each rank's own; every rank ends with the same parameters (rank 0 prints their checksum, and so does
rank 1).

    nccl-ddp-run --nproc-per-node 2 examples/paddle_ddp.py [--steps N]
    (in the Paddle venv: .venv-paddle/bin/python -m nccl_ddp.launch --nproc-per-node 2 ...)
"""

import argparse
import warnings

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found")  # Paddle's, at import on machines without ccache
import paddle  # noqa: E402
import paddle.nn as nn  # noqa: E402
import paddle.optimizer as opt  # noqa: E402

import nccl_ddp as nd  # noqa: E402


class LinearNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self._linear1 = nn.Linear(10, 10)
        self._linear2 = nn.Linear(10, 1)

    def forward(self, x):
        return self._linear2(self._linear1(x))


def train(steps: int) -> None:
    # 1. initialize the parallel environment (was: dist.init_parallel_env())
    nd.init_process_group()
    paddle.seed(2026 + nd.get_rank())  # a different initial layer per rank: rank 0's wins

    # 2. create the data parallel layer and optimizer (was: paddle.DataParallel(layer))
    layer = LinearNet()
    dp_layer = nd.DistributedDataParallel(layer)
    loss_fn = nn.MSELoss()
    adam = opt.Adam(learning_rate=0.001, parameters=dp_layer.parameters())

    # 3. run the layer
    for step in range(steps):
        inputs = paddle.randn([10, 10], "float32")
        outputs = dp_layer(inputs)
        labels = paddle.randn([10, 1], "float32")
        loss = loss_fn(outputs, labels)
        loss.backward()
        adam.step()
        adam.clear_grad()
        print(f"step {step}: loss {float(loss):.6f}", flush=True)
    total = sum(float(np.abs(p.numpy()).sum()) for p in dp_layer.parameters())
    print(f"rank {nd.get_rank()}: param checksum {total:.6f}", flush=True)
    dp_layer.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    train(p.parse_args().steps)
