"""Run by tests/adapters/mindspore_tests/test_mindspore_adapter.py on 2 ranks (nccl-ddp-run, the MindSpore
venv): DDP gives
every rank rank 0's frozen Parameters, BatchNorm statistics and registered buffers at
construction, and rank 0's buffers again at the start of each forward after a synchronised one.
Prints one line per rank: "ms_state_sync <json of the values seen>".
"""

import json

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

import nccl_ddp as nd


class Net(nn.Cell):
    """A frozen weight, a BatchNorm and a registered buffer, all different on every rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.frozen = Parameter(
            Tensor(np.full(3, float(rank), np.float32)), name="frozen", requires_grad=False
        )
        self.w = Parameter(Tensor(np.full(3, 1.0 + rank, np.float32)), name="w")
        self.bn = nn.BatchNorm1d(3, moving_mean_init=float(rank))
        self.register_buffer("count", Tensor(np.array([10.0 + rank], np.float32)))

    def construct(self, x):
        return (self.bn(x * self.w + self.frozen) ** 2).sum()


def values(net) -> dict:
    return {
        "frozen": net.frozen.asnumpy().tolist(),
        "w": net.w.asnumpy().tolist(),
        "mean": net.bn.moving_mean.asnumpy().tolist(),
        "count": net.count.asnumpy().tolist(),
    }


def main():
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    nd.init_process_group("host")
    rank = nd.get_rank()
    try:
        net = nd.DistributedDataParallel(Net(rank))
        seen = {"built": values(net.module)}
        # the wrapper is a Cell whose parameter names (and checkpoint) are the wrapped cell's
        seen["cell"] = isinstance(net, nn.Cell)
        seen["names"] = [
            list(net.parameters_dict()),
            list(Net(rank).parameters_dict()),
            [p.name for p in net.trainable_params()],
        ]
        path = f"ddp_rank{rank}.ckpt"
        ms.save_checkpoint(net, path)
        bare = Net(rank + 5)
        ms.load_param_into_net(bare, ms.load_checkpoint(path))
        params = ("frozen", "w", "mean")  # (a checkpoint holds Parameters, not buffers)
        seen["checkpoint"] = all(values(bare)[k] == values(net.module)[k] for k in params)
        x = Tensor(np.random.default_rng(rank).standard_normal((4, 3)).astype(np.float32))
        grad_fn = ms.value_and_grad(lambda x: net(x), None, net.trainable_params())
        net.set_train(True)
        grad_fn(x)  # a synchronised step: stats move locally
        seen["after_step"] = values(net.module)
        net.module.count.assign_value(Tensor(np.array([50.0 + rank], np.float32)))
        net.set_train(False)  # eval: this forward updates nothing
        net(x)  # ... but first takes rank 0's buffers
        seen["next_forward"] = values(net.module)
        net.close()
    finally:
        nd.destroy_process_group()
    print("ms_state_sync " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
