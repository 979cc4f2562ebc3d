"""Single-process references for the MindSpore examples (run in the MindSpore venv by
tests/adapters/mindspore_tests/test_mindspore_adapter.py; no nccl_ddp involved).

    python tests/support/ms_reference.py ddp OUT.npz --steps N --world W
        examples/ms_ddp_lenet.py's training, with each step's grad the mean of the W ranks' grads
        computed one after the other here: what data parallelism must produce.
    python tests/support/ms_reference.py grad-reducer OUT.npz --world W
        examples/ms_grad_reducer.py's Net after one Momentum step on the SUM of the ranks' grads
        (mean=False, as the example's auto-parallel context says); --mean: on their mean;
        --scale-by-rank as there.
    python tests/support/ms_reference.py all OUT_DIR --steps N --world W
        all of them in one process (MindSpore is slow to start): OUT_DIR/ddp.npz and
        OUT_DIR/grad-reducer-{sum,mean}-{docs,scaled}.npz.
"""

import argparse
import importlib.util
import os

import mindspore as ms
import numpy as np
from mindspore import nn
from paths import ROOT as REPO

ROOT = str(REPO)


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ddp_reference(steps, world):
    ex = load_example("ms_ddp_lenet")
    ms.set_seed(0)
    net = ex.LeNet5()
    optimizer = nn.AdamWeightDecay(net.trainable_params(), 1e-4)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())
    data = [ex.create_dataset(r, steps) for r in range(world)]
    for step in range(steps):
        per_rank = [[g.asnumpy() for g in grad_fn(*data[r][step])[1]] for r in range(world)]
        mean = tuple(ms.Tensor(sum(gs) / world) for gs in zip(*per_rank))
        optimizer(mean)
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def grad_reducer_reference(world, scale_by_rank, mean=False):
    ex = load_example("ms_grad_reducer")
    size, in_features, out_features = 16, 16, 10
    net = ex.Net(in_features, out_features)
    net_with_loss = nn.WithLossCell(net, nn.MSELoss())
    grad = ms.ops.GradOperation(get_by_list=True)
    params = net_with_loss.trainable_params()
    total = None
    for r in range(world):
        inputs, label = ex.rank_inputs(r, size, in_features, out_features, scale_by_rank)
        g = grad(net_with_loss, params)(inputs, label)[0].asnumpy()
        total = g if total is None else total + g
    optimizer = nn.Momentum(params, learning_rate=0.1, momentum=0.9)
    optimizer((ms.Tensor(total / world if mean else total),))
    return {"weight": net.weight.asnumpy()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("which", choices=["ddp", "grad-reducer", "all"])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--scale-by-rank", action="store_true")
    parser.add_argument("--mean", action="store_true")
    args = parser.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if args.which == "all":
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "ddp.npz"), **ddp_reference(args.steps, args.world))
        for mean in (False, True):
            for scaled in (False, True):
                name = f"grad-reducer-{'mean' if mean else 'sum'}-{'scaled' if scaled else 'docs'}"
                np.savez(
                    os.path.join(args.out, name + ".npz"), **grad_reducer_reference(args.world, scaled, mean)
                )
        return
    result = (
        ddp_reference(args.steps, args.world)
        if args.which == "ddp"
        else grad_reducer_reference(args.world, args.scale_by_rank, args.mean)
    )
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()
