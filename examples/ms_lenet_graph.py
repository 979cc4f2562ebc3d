"""examples/ms_ddp_lenet.py's training in MindSpore's GRAPH_MODE: DDP's grad hooks cannot run in a
compiled graph, so the step is MindSpore's own `nn.TrainOneStepCell` (compiled) with our
`DistributedGradReducer` as its `grad_reducer`, as MindSpore's data-parallel training sets it up.

    nccl-ddp-run --nproc-per-node 2 examples/ms_lenet_graph.py [--mode pynative] [--steps N]

Same LeNet5, synthetic data, AdamWeightDecay and seed as the DDP example; the reducer averages
(mean=True, degree = world size), as DDP with average_in_collective does, so both runs train the
same parameters. --mode pynative runs the same cell eagerly; --save PATH writes the parameters
("{rank}" in PATH: each rank its own file).
"""

import argparse
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import nn

import nccl_ddp as nd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ms_ddp_lenet import LeNet5, create_dataset  # noqa: E402  (the DDP example's model and data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["graph", "pynative"], default="graph")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save", help="write the trained parameters to this .npz")
    args = parser.parse_args()

    mode = ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE
    ms.set_device("CPU")
    ms.set_context(mode=mode)
    nd.init_process_group()
    ms.set_seed(0)  # the same initial parameters on every rank
    net = LeNet5()
    optimizer = nn.AdamWeightDecay(net.trainable_params(), 1e-4)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), optimizer)
    train_step.grad_reducer = nd.DistributedGradReducer(optimizer.parameters, mean=True)
    train_step.set_train()

    for step, (image, label) in enumerate(create_dataset(nd.get_rank(), args.steps), 1):
        loss = train_step(image, label)
        print(f"epoch: 0, step: {step}, loss is {float(loss.asnumpy()):.15f}")

    params = {p.name: p.asnumpy() for p in net.trainable_params()}
    print(f"param checksum: {sum(float(np.abs(v).sum()) for v in params.values()):.9e}")
    if args.save:
        np.savez(args.save.format(rank=nd.get_rank()), **params)
    train_step.grad_reducer.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
