"""MindSpore's nn.DistributedGradReducer example (the TrainingWrapper from its docs), run on CPU
with nccl_ddp: only the imports and the process-group start are changed.

    nccl-ddp-run --nproc-per-node 2 examples/ms_grad_reducer.py      # prints 256.0 on every rank

As in the docs, `construct` is compiled (GRAPH_MODE; --mode pynative runs it eagerly) and the mean
and degree come from the auto-parallel context: gradients_mean is False there, so the grads are
summed over the ranks. Options for the tests: --mean sets gradients_mean=True and device_num to
the world size (the step then uses the mean grad); --scale-by-rank multiplies rank r's inputs by
r+1; --save PATH writes the weight after the step ("{rank}" in PATH: each rank its own file).
"""

import argparse

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, context, nn, ops  # the docs use `context` unimported

import nccl_ddp as nd
from nccl_ddp import DistributedGradReducer  # was: nn.DistributedGradReducer


class TrainingWrapper(nn.Cell):
    def __init__(self, network, optimizer, sens=1.0):
        super().__init__(auto_prefix=False)
        self.network = network
        self.network.add_flags(defer_inline=True)
        self.weights = optimizer.parameters
        self.optimizer = optimizer
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.sens = sens
        self.reducer_flag = False
        self.grad_reducer = None
        self.parallel_mode = context.get_auto_parallel_context("parallel_mode")
        self.depend = ops.Depend()
        if self.parallel_mode in [ms.ParallelMode.DATA_PARALLEL, ms.ParallelMode.HYBRID_PARALLEL]:
            self.reducer_flag = True
        if self.reducer_flag:
            mean = context.get_auto_parallel_context("gradients_mean")
            degree = context.get_auto_parallel_context("device_num")
            self.grad_reducer = DistributedGradReducer(optimizer.parameters, mean, degree)

    def construct(self, *args):
        weights = self.weights
        loss = self.network(*args)
        sens = ops.Fill()(ops.DType()(loss), ops.Shape()(loss), self.sens)
        grads = self.grad(self.network, weights)(*args, sens)
        if self.reducer_flag:
            # apply grad reducer on grads
            grads = self.grad_reducer(grads)
        return self.depend(loss, self.optimizer(grads))


class Net(nn.Cell):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = Parameter(
            Tensor(np.ones([in_features, out_features]).astype(np.float32)), name="weight"
        )
        self.matmul = ops.MatMul()

    def construct(self, x):
        output = self.matmul(x, self.weight)
        return output


def rank_inputs(rank, size, in_features, out_features, scale_by_rank=False):
    """The docs' inputs (ones) and labels (zeros); rank r's inputs times r+1 if asked."""
    factor = float(rank + 1) if scale_by_rank else 1.0
    inputs = Tensor((factor * np.ones([size, in_features])).astype(np.float32))
    label = Tensor(np.zeros([size, out_features]).astype(np.float32))
    return inputs, label


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale-by-rank", action="store_true")
    parser.add_argument("--mean", action="store_true")
    parser.add_argument("--mode", choices=["graph", "pynative"], default="graph")
    parser.add_argument("--save", help="write the weight after the step to this .npz")
    args = parser.parse_args()

    mode = ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE
    ms.set_device("CPU")
    ms.set_context(mode=mode)
    nd.init_process_group()  # docs: init()
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL)
    if args.mean:
        ms.set_auto_parallel_context(gradients_mean=True, device_num=nd.get_world_size())

    size, in_features, out_features = 16, 16, 10
    network = Net(in_features, out_features)
    loss = nn.MSELoss()
    net_with_loss = nn.WithLossCell(network, loss)
    optimizer = nn.Momentum(net_with_loss.trainable_params(), learning_rate=0.1, momentum=0.9)
    train_cell = TrainingWrapper(net_with_loss, optimizer)
    inputs, label = rank_inputs(nd.get_rank(), size, in_features, out_features, args.scale_by_rank)
    grads = train_cell(inputs, label)
    print(grads)
    if args.save:
        np.savez(args.save.format(rank=nd.get_rank()), weight=network.weight.asnumpy())
    train_cell.grad_reducer.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
