"""MindSpore's DistributedDataParallel example (mindspore.parallel.distributed.DistributedDataParallel
docs), run on CPU with nccl_ddp: only the imports and the process-group start are changed.

    nccl-ddp-run --nproc-per-node 2 examples/ms_ddp_lenet.py [--steps N] [--save params.npz]

MindSpore itself needs numpy<2 (scripts/setup_ms_venv.sh makes the .venv-ms it runs in). The data
set is synthetic (the docs use MNIST): different images on every rank, the same in every run.
"""

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn

import nccl_ddp as nd
from nccl_ddp import DistributedDataParallel  # was: mindspore.parallel.distributed

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


class LeNet5(nn.Cell):
    """LeNet5 as in MindSpore's docs/mindspore/code/lenet.py (1x32x32 inputs, 10 classes)."""

    def __init__(self, num_class=10, num_channel=1):
        super().__init__()
        self.conv1 = nn.Conv2d(num_channel, 6, 5, pad_mode="valid")
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = nn.Dense(16 * 5 * 5, 120)
        self.fc2 = nn.Dense(120, 84)
        self.fc3 = nn.Dense(84, num_class)
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def create_dataset(rank, steps, batch=16):
    """A small synthetic MNIST stand-in: `steps` batches of (image, label) tensors for `rank`."""
    g = np.random.default_rng(2024 + rank)
    return [
        (
            ms.Tensor(g.standard_normal((batch, 1, 32, 32)).astype(np.float32)),
            ms.Tensor(g.integers(0, 10, batch).astype(np.int32)),
        )
        for _ in range(steps)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save", help="write the trained parameters of rank 0 to this .npz")
    args = parser.parse_args()

    nd.init_process_group()  # was: mindspore.mint.distributed.init_process_group()
    ms.set_seed(0)  # the docs' net starts alike on every rank; DDP syncs anyway
    net = LeNet5()
    net = DistributedDataParallel(
        module=net, bucket_cap_mb=None, average_in_collective=True, static_graph=True
    )
    # The docs use mindspore.mint.optim.AdamW; on CPU MindSpore 2.10 has no AdamW kernel ("The
    # kernel AdamW unregistered"), so this runs nn.AdamWeightDecay, the CPU equivalent.
    optimizer = nn.AdamWeightDecay(net.trainable_params(), 1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def forward_fn(data, target):
        logits = net(data)
        loss = loss_fn(logits, target)
        return loss, logits

    grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)

    dataset = create_dataset(nd.get_rank(), args.steps)
    for epoch in range(1):
        step = 0
        for image, label in dataset:
            (loss_value, _), grads = grad_fn(image, label)
            optimizer(grads)
            net.zero_grad()
            step += 1
            print(f"epoch: {epoch}, step: {step}, loss is {float(loss_value):.15f}")

    params = {p.name: p.asnumpy() for p in net.trainable_params()}
    print(f"param checksum: {sum(float(np.abs(v).sum()) for v in params.values()):.9e}")
    if args.save and nd.get_rank() == 0:
        np.savez(args.save, **params)
    net.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
