"""Single-process checks of the MindSpore adapter, run in the MindSpore venv by
tests/adapters/mindspore_tests/test_mindspore_adapter.py (a job of one: the collectives are identities, the
plumbing is not).
Prints "ms_checks: all passed" or raises.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

import nccl_ddp as nd
from nccl_ddp.errors import CommError, ConfigError, ReducerError


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="w")
        self.b = Parameter(Tensor(np.ones(3, np.float32)), name="b")

    def construct(self, x):
        return ((x @ self.w + self.b) ** 2).sum()


class Mixed(nn.Cell):
    """Three parameters: float32 (2, 3), float16 (3,), a float32 scalar."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="w")
        self.h = Parameter(Tensor(np.full(3, 0.5, np.float16)), name="h")
        self.s = Parameter(Tensor(np.array(1.5, np.float32)), name="s")

    def construct(self, x):
        y = ops.matmul(x, self.w) + ops.cast(self.h, ms.float32)
        return (y**2).sum() * self.s


class ReducedGrads(nn.Cell):
    """Like MindSpore's TrainingWrapper, without the optimizer: the reduced grads come out."""

    def __init__(self, net, reducer):
        super().__init__(auto_prefix=False)
        self.net = net
        self.weights = ms.ParameterTuple(net.trainable_params())
        self.grad = ops.GradOperation(get_by_list=True)
        self.grad_reducer = reducer

    def construct(self, x):
        grads = self.grad(self.net, self.weights)(x)
        return self.grad_reducer(grads)


def graph_mode_reducer_cell():
    """In GRAPH_MODE the reducer is compiled into the construct; its buckets follow dtype and
    fusion ids; it divides by degree when mean; PyNative gives the same numbers."""
    net = Mixed()
    x = Tensor(np.array([[1.0, -2.0], [0.5, 3.0]], np.float32))
    plain = [
        np.asarray(g.asnumpy())
        for g in ops.GradOperation(get_by_list=True)(net, ms.ParameterTuple(net.trainable_params()))(x)
    ]
    for fusion_type, mean, buckets in ((1, True, 2), (0, False, 3)):
        reducer = nd.DistributedGradReducer(net.trainable_params(), mean, 4, fusion_type=fusion_type)
        assert isinstance(reducer, nn.Cell), type(reducer)
        assert len(reducer.bucket_ops) == buckets, (fusion_type, reducer.bucket_ops)
        want = [np.asarray(g / 4 if mean else g, g.dtype) for g in plain]
        results = {}
        for mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
            ms.set_context(mode=mode)
            out = ReducedGrads(net, reducer)(x)
            assert len(out) == 3, out
            results[mode] = [g.asnumpy() for g in out]
            for got, w in zip(results[mode], want):
                assert got.dtype == w.dtype and got.shape == w.shape, (mode, got, w)
                np.testing.assert_allclose(got, w, rtol=1e-3 if w.dtype == np.float16 else 1e-6)
        for g, p in zip(results[ms.GRAPH_MODE], results[ms.PYNATIVE_MODE]):
            np.testing.assert_array_equal(g, p)
        reducer.close()


def jit_step_uses_the_bucket_ops():
    """In PyNative mode, a `@ms.jit` step compiles the reducer too: its bucket op runs (and the
    grads come out divided by degree); a failed earlier step surfaces in the graph as our
    `ReducerError`, not as a MindSpore error."""
    net = nn.Dense(3, 2)
    reducer = nd.DistributedGradReducer(net.trainable_params(), True, 4)
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, net.trainable_params())
    ran = []
    reduce_bucket = reducer.reducer.reduce_bucket
    reducer.reducer.reduce_bucket = lambda b, grads: (ran.append(b), reduce_bucket(b, grads))[1]

    @ms.jit
    def step(x, y):
        _, grads = grad_fn(x, y)
        return reducer(grads)

    x, y = Tensor(np.ones((4, 3), np.float32)), Tensor(np.zeros((4, 2), np.float32))
    reduced = [g.asnumpy() for g in step(x, y)]  # (PyNative runs the compiled step async)
    assert ran == [0], ran
    for g, p in zip(reduced, grad_fn(x, y)[1]):
        np.testing.assert_allclose(g, p.asnumpy() / 4, rtol=1e-6)
    reducer.reducer._failure.error = CommError("rank 1 died (simulated)")
    try:
        step(x, y)[0].asnumpy()
    except ReducerError as e:
        assert "a previous step failed" in str(e), e
    else:
        raise AssertionError("the compiled step ran after a failed one")
    reducer.close()


def comm_fusion_ids_as_in_mindspore():
    """Parameters' comm_fusion ids (every MindSpore Parameter has one, 1 by default) override
    fusion_type only when they differ, as in MindSpore's reducer."""
    net = Tiny()  # two float32 parameters
    for fusion_type, ids, buckets in (
        (1, (1, 1), 1),
        (0, (1, 1), 2),
        (0, (2, 2), 2),
        (1, (1, 2), 2),
        (5, (3, 3), 1),
    ):
        net.w.comm_fusion, net.b.comm_fusion = ids
        reducer = nd.DistributedGradReducer(net.trainable_params(), fusion_type=fusion_type)
        assert len(reducer.bucket_ops) == buckets, (fusion_type, ids, reducer.bucket_ops)
        reducer.close()


def graph_mode_reducer_rejects_wrong_grads():
    """A grad tuple of the wrong length fails when the graph is compiled, naming both counts."""
    net = Mixed()
    reducer = nd.DistributedGradReducer(net.trainable_params())

    class TwoGrads(nn.Cell):
        def __init__(self):
            super().__init__()
            self.grad_reducer = reducer

        def construct(self, a, b):
            return self.grad_reducer((a, b))

    try:
        fails_in_graph_mode(
            lambda: TwoGrads()(Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones(3, np.float16))),
            ValueError,
            "2 grads for 3 parameters",
        )
    finally:
        reducer.close()


def graph_mode_is_refused():
    fails_in_graph_mode(lambda: nd.DistributedDataParallel(Tiny()), ConfigError, "PyNative")


def fails_in_graph_mode(call, error, text):
    """`call()` in GRAPH_MODE raises `error` saying `text` (then back to PyNative mode)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        call()
    except error as e:
        assert text in str(e), e
    else:
        raise AssertionError(f"no {error.__name__} ({text}) in GRAPH_MODE")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def ddp_accumulates_until_zero_grad():
    net = nd.DistributedDataParallel(Tiny())
    grad_fn = ms.value_and_grad(lambda x: net(x), None, net.trainable_params())
    x = Tensor(np.array([[1.0, 2.0]], np.float32))
    _, g1 = grad_fn(x)
    first = [g.asnumpy().copy() for g in g1]
    assert np.abs(first[0]).sum() > 0
    _, g2 = grad_fn(x)  # no zero_grad: DDP accumulates (MindSpore semantics)
    for a, b in zip(first, g2):
        np.testing.assert_allclose(b.asnumpy(), 2 * a, rtol=1e-6)
    net.zero_grad()
    for g in g2:  # the returned grads alias our bucket memory
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


def grad_reducer_names_the_parameter():
    """bf16 grads for float32 parameters (before: RuntimeError: Unsupported dtype in DLTensor.),
    a wrong shape, and grads of another framework: the message names the parameter."""
    net = Tiny()
    reducer = nd.DistributedGradReducer(net.trainable_params(), mean=True)
    good = Tensor(np.ones((2, 3), np.float32))
    for grads, error, text in (
        (
            (good, Tensor(np.ones(3, np.float32)).astype(ms.bfloat16)),
            ConfigError,
            "grad 'b' (grads[1]): dtype differs: the grad is bfloat16, its parameter float32",
        ),
        (
            (good, Tensor(np.ones(4, np.float32))),
            ConfigError,
            "grad 'b' (grads[1]): shape differs: the grad has (4,), its parameter (3,)",
        ),
        (
            (good, np.ones(3, np.float32)),
            TypeError,
            "grads[1] is a numpy.ndarray (NumPy), but this reducer was built on MindSpore parameters",
        ),
    ):
        try:
            reducer(grads)
        except error as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"no {error.__name__} for {text}")
    reducer.close()


def main():
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    nd.init_process_group("host")
    try:
        graph_mode_is_refused()
        ddp_accumulates_until_zero_grad()
        grad_reducer_returns_tensors()
        grad_reducer_names_the_parameter()
        graph_mode_reducer_cell()
        comm_fusion_ids_as_in_mindspore()
        jit_step_uses_the_bucket_ops()
        graph_mode_reducer_rejects_wrong_grads()
    finally:
        nd.destroy_process_group()
    print("ms_checks: all passed")


if __name__ == "__main__":
    main()
