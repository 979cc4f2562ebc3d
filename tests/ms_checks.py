"""Single-process checks of the MindSpore adapter, run in the MindSpore venv by
tests/test_mindspore_adapter.py (a job of one: the collectives are identities, the plumbing is not).
Prints "ms_checks: all passed" or raises.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn

import nccl_ddp as nd


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="w")
        self.b = Parameter(Tensor(np.ones(3, np.float32)), name="b")

    def construct(self, x):
        return ((x @ self.w + self.b) ** 2).sum()


def graph_mode_is_refused():
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        nd.DistributedDataParallel(Tiny())
    except RuntimeError as e:
        assert "PyNative" in str(e), e
    else:
        raise AssertionError("DDP over MindSpore accepted GRAPH_MODE")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def ddp_accumulates_until_zero_grad():
    net = nd.DistributedDataParallel(Tiny())
    grad_fn = ms.value_and_grad(lambda x: net(x), None, net.trainable_params())
    x = Tensor(np.array([[1.0, 2.0]], np.float32))
    _, g1 = grad_fn(x)
    first = [g.asnumpy().copy() for g in g1]
    assert np.abs(first[0]).sum() > 0
    _, g2 = grad_fn(x)                   # no zero_grad: DDP accumulates (MindSpore semantics)
    for a, b in zip(first, g2):
        np.testing.assert_allclose(b.asnumpy(), 2 * a, rtol=1e-6)
    net.zero_grad()
    for g in g2:                         # the returned grads alias our bucket memory
        assert not g.asnumpy().any(), "value_and_grad's grads do not alias the buckets"
    _, g3 = grad_fn(x)
    for a, b in zip(first, g3):
        np.testing.assert_allclose(b.asnumpy(), a, rtol=1e-6)
    net.close()


def grad_reducer_returns_tensors():
    net = Tiny()
    reducer = nd.DistributedGradReducer(net.trainable_params(), mean=True)
    grads = (Tensor(np.full((2, 3), 3.0, np.float32)), Tensor(np.full(3, -1.0, np.float32)))
    out = reducer(grads)
    assert isinstance(out, tuple) and all(isinstance(t, Tensor) for t in out), out
    np.testing.assert_array_equal(out[0].asnumpy(), np.full((2, 3), 3.0, np.float32))
    np.testing.assert_array_equal(out[1].asnumpy(), np.full(3, -1.0, np.float32))
    reducer.close()


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    nd.init_process_group("host")
    try:
        graph_mode_is_refused()
        ddp_accumulates_until_zero_grad()
        grad_reducer_returns_tensors()
    finally:
        nd.destroy_process_group()
    print("ms_checks: all passed")


if __name__ == "__main__":
    main()
