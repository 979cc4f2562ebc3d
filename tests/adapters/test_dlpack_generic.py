"""The generic DLPack path (nccl_ddp.adapters.generic) on a fake framework that speaks only DLPack
(tests/support/fakefw.py): the functional collectives, DistributedGradReducer and the array form of
DDP take its arrays and hand back arrays of its own, its dtype objects are read as its own, and
frameworks we cannot exchange with are refused naming them and the way out. 2 ranks as threads
(FakeGroup); TensorFlow's and Paddle's real arrays are tested in their own venvs."""

from __future__ import annotations

import fakefw
import numpy as np
import pytest
from fakegroup import FakeGroup, _Shared, run_threads

import nccl_ddp as nd
from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import numpy_dtype
from nccl_ddp.errors import ConfigError, ConfigTypeError

F32, F64 = np.float32, np.float64


class _TFLikeDType:
    """TensorFlow's DType: str() is "<dtype: 'float32'>", the NumPy type is an attribute."""

    as_numpy_dtype = np.float32

    def __str__(self) -> str:
        return "<dtype: 'float32'>"


class _NamedDType:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


@pytest.mark.parametrize(
    "dtype, want",
    [
        (np.float32, F32),
        ("float64", F64),
        (fakefw.float32, F32),  # DataType.FLOAT32-style: .name "FLOAT32"
        (_TFLikeDType(), F32),
        (_NamedDType("paddle.float16"), np.float16),
        (_NamedDType("<dtype: 'int32'>"), np.int32),
        ("fp64", F64),
    ],
)
def test_numpy_dtype_reads_the_frameworks_own_dtypes(dtype, want):
    assert numpy_dtype(dtype) == np.dtype(want)


def test_numpy_dtype_reads_bfloat16_names():
    pytest.importorskip("ml_dtypes")
    assert numpy_dtype(_NamedDType("paddle.bfloat16")).name == "bfloat16"


def test_numpy_dtype_refuses_what_numpy_cannot_hold():
    with pytest.raises(ConfigTypeError, match="dtype fakefw.qint8 .*no NumPy equivalent"):
        numpy_dtype(fakefw.DType("qint8"))


def test_framework_of_names_any_array_library():
    assert frameworks.framework_of(fakefw.Tensor(np.ones(2))) == "fakefw"
    assert frameworks.framework_of(fakefw.NoDLPackTensor(np.ones(2))) == "nodlpackfw"
    assert frameworks.framework_of(np.ones(2)) is None
    assert frameworks.framework_of([fakefw.Tensor(np.ones(2))]) is None
    assert frameworks.framework_of_leaves([fakefw.Tensor(np.ones(2))]) == "fakefw"
    assert frameworks.ADAPTERS["jax"].immutable and not frameworks.ADAPTERS["torch"].immutable


# -- DistributedGradReducer ------------------------------------------------------------------------


def _params():
    return [fakefw.Tensor(np.zeros((3, 2), F32), name="w"), fakefw.Tensor(np.zeros(5, F64), name="b")]


def _grads(rank, read_only=False):
    rng = np.random.default_rng(rank)
    return [fakefw.Tensor(rng.standard_normal(p.shape).astype(p._a.dtype), read_only) for p in _params()]


def _reduce(group, container, read_only):
    red = nd.DistributedGradReducer(_params(), group=group)
    mine = _grads(group.rank, read_only)
    before = [g.numpy() for g in mine]
    out = red(container(mine))
    unchanged = all(np.array_equal(g.numpy(), b) for g, b in zip(mine, before))
    return out, unchanged


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
@pytest.mark.parametrize("container", [list, tuple])
def test_grad_reducer_returns_the_frameworks_arrays(container, read_only):
    results = run_threads(_reduce, 2, container, read_only)
    want = [(a.numpy() + b.numpy()) / 2 for a, b in zip(_grads(0), _grads(1))]
    for out, unchanged in results:
        assert type(out) is container and unchanged
        for o, w in zip(out, want):
            assert type(o) is fakefw.Tensor and o.dtype == fakefw.DType(w.dtype.name)
            np.testing.assert_allclose(o.numpy(), w, rtol=1e-6)
            assert not o._a.flags.owndata  # fakefw's from_dlpack kept the bucket memory: no copy


def one_group():
    return FakeGroup(_Shared(1, 5.0), 0, 1)


@pytest.mark.parametrize(
    "grads, exc, match",
    [
        (
            [np.zeros((3, 2), F32), np.zeros(5, F64)],
            ConfigTypeError,
            r"grads\[0\] is a numpy.ndarray \(NumPy\).*"
            "built on fakefw parameters.*never mixes",
        ),
        (
            [fakefw.Tensor(np.zeros((3, 2), F64)), fakefw.Tensor(np.zeros(5))],
            ConfigError,
            "grad 'w' .*dtype differs: the grad is float64, its parameter float32",
        ),
        (
            [fakefw.Tensor(np.zeros(6, F32)), fakefw.Tensor(np.zeros(5))],
            ConfigError,
            "grad 'w' .*shape differs",
        ),
        ([None, fakefw.Tensor(np.zeros(5))], ConfigError, r"grads\[0\] is None.*pass zeros"),
        ({"w": 1}, ConfigTypeError, "grads must be a list or tuple of fakefw arrays"),
    ],
    ids=["numpy-grads", "dtype", "shape", "none", "dict"],
)
def test_grad_reducer_refuses_bad_grads_naming_them(grads, exc, match):
    red = nd.DistributedGradReducer(_params(), group=one_group())
    with pytest.raises(exc, match=match):
        red(grads)
    out = red(_grads(0))  # still works
    np.testing.assert_array_equal(out[1].numpy(), _grads(0)[1].numpy())


@pytest.mark.parametrize(
    "params, exc, match",
    [
        (
            [fakefw.Tensor(np.zeros(2, F32)), np.zeros(2, F32)],
            ConfigTypeError,
            r"parameters\[1\] is a numpy.ndarray.*built on fakefw parameters",
        ),
        (
            [fakefw.NoFromTensor(np.zeros(2, F32))],
            ConfigTypeError,
            "'nofromfw' has arrays with __dlpack__ but no from_dlpack.*x.numpy",
        ),
        (
            [fakefw.NoDLPackTensor(np.zeros(2, F32))],
            ConfigTypeError,
            r"nodlpackfw.Tensor: nodlpackfw arrays have no __dlpack__.*\(x.numpy\(\)\)",
        ),
    ],
    ids=["mixed", "no-from_dlpack", "no-__dlpack__"],
)
def test_grad_reducer_refuses_parameters_it_cannot_exchange(params, exc, match):
    with pytest.raises(exc, match=match):
        nd.DistributedGradReducer(params, group=one_group())


# -- the functional collectives -------------------------------------------------------------------


@pytest.fixture(scope="module")
def world1():
    with pytest.MonkeyPatch.context() as mp:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(k, raising=False)
        nd.init_process_group("host", timeout=10)
        yield
        nd.destroy_process_group()


def _collectives(group, read_only):
    x = fakefw.Tensor(np.full(4, group.rank + 1.0, F32), read_only)
    out = nd.all_reduce(x, group=group)
    y = fakefw.Tensor(np.full(3, group.rank + 5.0, F64), read_only)
    got = nd.broadcast(y, src=1, group=group)
    return x, out, y, got


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_collectives_hand_back_the_frameworks_arrays(world1, read_only):
    for rank, (x, out, y, got) in enumerate(run_threads(_collectives, 2, read_only)):
        assert type(out) is fakefw.Tensor and type(got) is fakefw.Tensor
        np.testing.assert_array_equal(out.numpy(), np.full(4, 3.0))
        np.testing.assert_array_equal(got.numpy(), np.full(3, 6.0))
        if read_only:  # copied in, a new array out, the input untouched
            assert out is not x and got is not y
            np.testing.assert_array_equal(x.numpy(), np.full(4, rank + 1.0))
        else:  # written in place, zero-copy
            assert out is x and got is y


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
def test_collectives_refuse_a_framework_without_dlpack(world1, collective):
    x = fakefw.NoDLPackTensor(np.ones(3, F32))
    with pytest.raises(
        ConfigTypeError, match=r"nodlpackfw.Tensor: nodlpackfw arrays have no __dlpack__.*x.numpy"
    ):
        getattr(nd, collective)(x)


# -- DistributedDataParallel on a list of the framework's arrays ---------------------------------


def _ddp(group):
    rng = np.random.default_rng(group.rank)
    params = {"w": fakefw.Tensor(rng.standard_normal(4).astype(F32)), "b": fakefw.Tensor(np.zeros(2, F64))}
    model = ArrayModule(params)
    ddp = nd.DistributedDataParallel(model, process_group=group)
    ddp.mark_ready("b", grad=fakefw.Tensor(np.full(2, group.rank + 1.0, F64)))
    ddp.mark_ready("w", grad=fakefw.Tensor(np.full(4, 2.0 * group.rank, F32), read_only=True))
    return params["w"].numpy(), {k: (type(g), g.numpy()) for k, g in model.grads.items()}


def test_ddp_array_form_on_the_frameworks_arrays():
    w0 = np.random.default_rng(0).standard_normal(4).astype(F32)
    for w, grads in run_threads(_ddp, 2):
        np.testing.assert_array_equal(w, w0)  # rank 0's values, written into the caller's tensor
        assert grads["w"][0] is fakefw.Tensor and grads["b"][0] is fakefw.Tensor
        np.testing.assert_array_equal(grads["w"][1], np.full(4, 1.0))
        np.testing.assert_array_equal(grads["b"][1], np.full(2, 1.5))


@pytest.mark.parametrize(
    "params, exc, match",
    [
        (
            [fakefw.Tensor(np.zeros(2, F32)), np.zeros(2, F32)],
            ConfigTypeError,
            "mix frameworks .*fakefw, numpy",
        ),
        (
            [fakefw.Tensor(np.zeros(2, F32), read_only=True)],
            ConfigError,
            r"params\[0\] is read-only.*Reducer",
        ),
        ([fakefw.NoDLPackTensor(np.zeros(2, F32))], ConfigTypeError, "nodlpackfw arrays have no __dlpack__"),
    ],
    ids=["mixed", "read-only", "no-__dlpack__"],
)
def test_array_module_refuses_what_it_cannot_write(params, exc, match):
    with pytest.raises(exc, match=match):
        ArrayModule(params)
