"""MindSpore DDP inside `nccl_ddp.Join` with the bf16 comm hook and check_finite (2 ranks with 2 and
4 batches; run by tests/adapters/mindspore_tests/test_join_mindspore.py through nccl-ddp-run in the MindSpore
venv)."""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

import nccl_ddp as nd
from nccl_ddp import hooks


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.d = nn.Dense(2, 3)

    def construct(self, x):
        return self.d(x).sum()


def main():
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    nd.init_process_group("host", timeout=60)
    rank = nd.get_rank()
    try:
        net = nd.DistributedDataParallel(Tiny(), check_finite=True)
        net.register_comm_hook(None, hooks.bf16_compress)
        start = [p.asnumpy().copy() for p in net.trainable_params()]
        grad_fn = ms.value_and_grad(lambda x: net(x), None, net.trainable_params())
        lr = 0.125
        with net.join(divide_by_initial_world_size=False):
            for step in range([2, 4][rank]):
                # d/dW sum(W x + b) = x: rank r sends x = r + 1; while both train the mean is 1.5,
                # then rank 1 alone divides by the one rank still training
                _, g = grad_fn(Tensor(np.full((1, 2), float(rank + 1), np.float32)))
                want = 1.5 if step < 2 else 2.0
                np.testing.assert_array_equal(g[0].asnumpy(), np.full((3, 2), want, np.float32))
                np.testing.assert_array_equal(g[1].asnumpy(), np.ones(3, np.float32))
                assert net.last_step_finite is True
                for p, gi in zip(net.trainable_params(), g):
                    p.set_data(Tensor(p.asnumpy() - lr * gi.asnumpy()))
                net.zero_grad()
        # every rank ends with the last joiner's (rank 1's) parameters
        final = [p.asnumpy() for p in net.trainable_params()]
        np.testing.assert_allclose(final[0], start[0] - lr * (1.5 + 1.5 + 2 + 2), rtol=1e-6)
        np.testing.assert_allclose(final[1], start[1] - lr * 4.0, rtol=1e-6)
        net.close()
    finally:
        nd.destroy_process_group()
    print(f"ms_join: rank {rank} passed", flush=True)


if __name__ == "__main__":
    main()
