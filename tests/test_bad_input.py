"""Bad input to the public API: each gets TypeError / ValueError / an nccl_ddp.errors class whose
message names the parameter (and rank) and what to do, and nothing is lost: the group, the DDP
step or the reducer still works afterwards. Host backend, 1 and 2 ranks, and the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mp import run_ranks

import nccl_ddp as nd
from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.errors import ConfigError, ConfigTypeError, RankMismatchError, ReducerError

_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
)


def _read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.fixture(scope="module")
def clean_env():
    with pytest.MonkeyPatch.context() as mp:
        for k in _ENV:
            mp.delenv(k, raising=False)
        yield
    nd.destroy_process_group()


@pytest.fixture(scope="module")
def world1(clean_env):
    nd.init_process_group("host", timeout=10)
    yield
    nd.destroy_process_group()


def _ok(world1) -> None:
    """The world group still works after the rejected call."""
    x = np.arange(3, dtype=np.float32)
    assert nd.all_reduce(x) is x
    np.testing.assert_array_equal(x, np.arange(3))


# -- before init and init_process_group --------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: nd.all_reduce(np.ones(2)),
        lambda: nd.broadcast(np.ones(2)),
        lambda: nd.barrier(),
        lambda: nd.new_group([0]),
        lambda: nd.get_rank(),
        lambda: nd.DistributedDataParallel([np.ones(2, np.float32)]),
        lambda: nd.DistributedGradReducer([np.ones(2, np.float32)]),
    ],
)
def test_calls_before_init_name_init_process_group(clean_env, call):
    with pytest.raises(ConfigError, match="before init_process_group.*call nccl_ddp.init"):
        call()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(backend="mpi"), ConfigError, "unknown backend 'mpi'.*'host' \\(torch's 'gloo'\\), 'nccl'"),
        (dict(backend="cuda:gloo"), ConfigError, "unknown backend 'cuda:gloo'"),
        (dict(backend="cpu:gloo,cuda:ucc"), ConfigError, "unknown backend"),
        (dict(backend=1), TypeError, "backend must be a string or None, got int 1"),
        (dict(timeout=0), ConfigError, "timeout must be a finite number of seconds > 0"),
        (dict(timeout=-1), ConfigError, "init_process_group: timeout must be .*> 0.*got -1"),
        (dict(timeout=float("nan")), ConfigError, "timeout"),
        (dict(timeout=float("inf")), ConfigError, "timeout must be a finite"),
        (dict(timeout="30"), TypeError, "timeout must be a number of seconds, got str"),
        (dict(timeout=True), TypeError, "timeout must be a number.*bool"),
        (dict(timeout=None), TypeError, "timeout must be a number.*NoneType"),
        (dict(rank=1), ConfigError, "world size is not.*WORLD_SIZE"),
        (dict(rank=-1, world_size=1), ConfigError, "rank -1 is outside"),
        (dict(rank=2, world_size=2), ConfigError, "rank 2 is outside"),
        (dict(rank=0, world_size=0), ConfigError, "world size is 0"),
        (dict(rank="0", world_size=1), TypeError, "rank must be an int"),
        (dict(rank=0, world_size=True), TypeError, "world_size must be an int"),
        (dict(store="x"), TypeError, "store must be a key-value store"),
    ],
)
def test_init_process_group_refuses_bad_arguments(clean_env, kwargs, exc, match):
    kwargs.setdefault("backend", "host")
    with pytest.raises(exc, match=match):
        nd.init_process_group(**kwargs)
    assert not nd.is_initialized()


@pytest.mark.parametrize("var", ["NCCL_DDP_HOST_CHUNK_BYTES", "NCCL_DDP_HOST_TRANSPORT"])
def test_bad_environment_knob_is_named(clean_env, monkeypatch, var):
    monkeypatch.setenv(var, "abc")
    with pytest.raises(ConfigError, match=f"{var}='abc'"):
        nd.init_process_group("host", timeout=10)
    assert not nd.is_initialized()


def test_init_twice_keeps_the_first_group(world1):
    with pytest.raises(ConfigError, match="called twice.*destroy_process_group"):
        nd.init_process_group("host")
    _ok(world1)


# -- collectives ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array, match",
    [
        (np.ones(3, np.complex64), "dtype complex64 is not supported.*use one of"),
        (np.array([1, 2], dtype=object), "dtype object is not supported"),
        (np.array(["a", "b"]), "dtype <U1 is not supported"),
        (np.ones(3, np.uint32), "dtype uint32 is not supported"),
        (np.zeros(2, dtype=[("a", "f4")]), "is not supported"),
        ([1.0, 2.0], "expected an array that supports DLPack.*builtins.list"),
        (3.0, "supports DLPack.*float"),
        (None, "supports DLPack.*NoneType"),
    ],
)
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
def test_unsupported_arrays_are_refused(world1, collective, array, match):
    with pytest.raises(ConfigTypeError, match=match):
        getattr(nd, collective)(array)
    _ok(world1)


@pytest.mark.parametrize(
    "op, exc, match",
    [
        ("bogus", ValueError, "unknown reduce op 'bogus'.*'sum', 'avg'"),
        ("mean", ValueError, "unknown reduce op 'mean'"),
        (None, ValueError, "unknown reduce op None"),
        (3, ValueError, "unknown reduce op 3"),
    ],
)
def test_wrong_op_names(world1, op, exc, match):
    with pytest.raises(exc, match=match):
        nd.all_reduce(np.ones(2, np.float32), op=op)
    with pytest.raises(ConfigError, match="op avg is not defined for bool; use max or min"):
        nd.all_reduce(np.array([True, False]), op="avg")
    _ok(world1)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda x: nd.broadcast(x, src=5), ConfigError, "rank 0: broadcast.*src rank 5 is not a"),
        (lambda x: nd.broadcast(x, src=-1), ConfigError, "src rank -1 is not a member"),
        (lambda x: nd.broadcast(x, src="0"), TypeError, "rank 0: broadcast.*src must be an int.*str"),
        (lambda x: nd.broadcast(x, src=0.0), TypeError, "src must be an int.*float"),
        (lambda x: nd.all_reduce(x, group="world"), ConfigError, "group must be a ProcessGroup"),
        (lambda x: nd.all_reduce(x, async_op="yes"), TypeError, "async_op must be a bool"),
        (lambda x: nd.all_gather([x, x], x), ConfigError, "out has 2 arrays but the group has 1"),
        (lambda x: nd.all_gather(np.zeros(3, np.float32), x), ConfigError, "out must hold group size"),
        (lambda x: nd.all_gather(np.zeros(4, np.float64), x), ConfigError, "out is float64 but input"),
        (lambda x: nd.reduce_scatter(np.zeros(3, np.float32), x), ConfigError, "input must hold"),
        (lambda x: nd.new_group([5]), ConfigError, r"ranks \[5\] are not members"),
        (lambda x: nd.new_group([]), ConfigError, "are not members"),
        (lambda x: nd.new_group([0, 0]), ConfigError, "more than once"),
        (lambda x: nd.new_group("ab"), TypeError, "ranks must be a list of global ranks.*str"),
        (lambda x: nd.new_group(0), TypeError, "ranks must be a list"),
        (lambda x: nd.new_group({0: 1}), TypeError, "ranks must be a list.*dict"),
        (lambda x: nd.new_group([0.0]), TypeError, "ranks must be ints"),
    ],
)
def test_bad_collective_arguments(world1, call, exc, match):
    with pytest.raises(exc, match=match):
        call(np.arange(4, dtype=np.float32))
    _ok(world1)


def test_odd_but_valid_arrays_work(world1):
    """0-d, empty, read-only and non-contiguous arrays are reduced; read-only ones are not
    written (a new array comes back), non-contiguous ones are written back in place."""
    assert float(nd.all_reduce(np.array(2.0, np.float32), op="max")) == 2.0
    assert nd.all_reduce(np.zeros(0, np.float32)).size == 0
    ro = _read_only(np.arange(3, dtype=np.float32))
    out = nd.all_reduce(ro)
    assert out is not ro and not ro.flags.writeable
    strided = np.arange(8, dtype=np.float32)[::2]
    assert nd.all_reduce(strided, op="prod") is strided
    np.testing.assert_array_equal(strided, [0, 2, 4, 6])
    work = nd.all_reduce(np.ones(2, np.float32), async_op=True)
    with pytest.raises(ConfigError, match="Work.wait: timeout must be a finite number"):
        work.wait(timeout=-1)
    with pytest.raises(TypeError, match="Work.wait: timeout must be a number of seconds, got str"):
        work.wait(timeout="5")
    assert work.wait(timeout=5)
    _ok(world1)


# -- DistributedDataParallel ---------------------------------------------------------------------


def _params():
    return {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(bucket_cap_mb=-1), ValueError, "bucket_cap_mb must be a finite number >= 0 MiB, got -1"),
        (dict(bucket_cap_mb="25"), TypeError, "bucket_cap_mb must be a number of MiB.*str '25'"),
        (dict(bucket_cap_mb=True), TypeError, "bucket_cap_mb must be a number.*bool"),
        (dict(bucket_cap_mb=float("nan")), ValueError, "bucket_cap_mb.*nan"),
        (dict(bucket_cap_mb=float("inf")), ValueError, "bucket_cap_mb must be a finite"),
        (dict(reducer_mode="x"), ValueError, "reducer_mode must be one of.*CppReducer.*'x'"),
        (dict(reducer_mode=None), ValueError, "reducer_mode must be one of"),
        (dict(process_group="world"), TypeError, "process_group must be a ProcessGroup"),
        (dict(init_sync=1), TypeError, "init_sync must be a bool, got int"),
        (dict(find_unused_parameters="yes"), TypeError, "find_unused_parameters must be a bool"),
        (dict(average_in_collective=0), TypeError, "average_in_collective must be a bool"),
        (dict(static_graph=None), TypeError, "static_graph must be a bool"),
    ],
)
def test_ddp_refuses_bad_options(world1, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nd.DistributedDataParallel(_params(), **kwargs)
    _ok(world1)


@pytest.mark.parametrize(
    "module, exc, match",
    [
        (None, TypeError, "module must be a model of a supported framework.*NoneType"),
        ("abc", TypeError, "module must be a model.*str"),
        (np.ones(3, np.float32), TypeError, "module must be a model.*numpy.ndarray"),
        ([], RuntimeError, "module has no parameters"),
        ({}, RuntimeError, "module has no parameters"),
        ([np.ones(3, np.int32)], TypeError, "parameter 0 has dtype int32; only floating point"),
        ([np.ones(3, np.complex64)], TypeError, "parameter 0 has dtype complex64; only floating"),
        ({"w": np.ones(6, np.float32)[::2]}, ValueError, r"params\['w'\] must be C-contiguous"),
        ([_read_only(np.ones(3, np.float32))], ValueError, r"params\[0\] is read-only.*x.copy"),
        ([[1.0, 2.0]], TypeError, "must be an array .NumPy, CuPy or any.*got builtins.list.*torch.nn.Module"),
        ({1: np.ones(3, np.float32)}, TypeError, "dict keys must be str"),
    ],
)
def test_ddp_refuses_bad_modules(world1, module, exc, match):
    with pytest.raises(exc, match=match):
        nd.DistributedDataParallel(module)
    _ok(world1)


def test_ddp_bucket_cap_zero_gives_one_bucket_per_parameter(world1):
    ddp = nd.DistributedDataParallel(_params(), bucket_cap_mb=0)
    assert len(ddp.reducer.layout.buckets) == 2
    ddp.close()


@pytest.mark.parametrize(
    "param, grad, exc, match",
    [
        ("nope", np.ones(2, np.float32), ReducerError, "rank 0: unknown parameter 'nope'.*0..1"),
        (5, np.ones(2, np.float32), ReducerError, "unknown parameter index 5; the module has 2"),
        (-1, np.ones(2, np.float32), ReducerError, "unknown parameter index -1"),
        (True, np.ones(2, np.float32), ReducerError, "unknown parameter a bool"),
        (None, None, ReducerError, "unknown parameter a NoneType"),
        (
            "b",
            np.ones(3, np.float32),
            ValueError,
            r"rank 0: grad of parameter 1 \('b'\) has shape \(3,\), the parameter \(2,\)",
        ),
        ("b", np.array(1.0, np.float32), ValueError, r"has shape \(\)"),
        ("b", np.ones(2, np.float64), TypeError, "parameter 1 .'b'. has dtype float64.*astype"),
        ("b", np.ones(2, np.complex64), TypeError, "dtype complex64"),
        ("b", np.ones(2, np.int64), TypeError, "dtype int64"),
        ("b", [1.0, 2.0], TypeError, "must be a numpy.ndarray like the parameter, got builtins.list"),
        ("b", 1.0, TypeError, "must be a numpy.ndarray like the parameter, got builtins.float"),
    ],
)
def test_rejected_mark_ready_loses_nothing(world1, param, grad, exc, match):
    model = ArrayModule(_params(), forward=lambda p, x: x)
    ddp = nd.DistributedDataParallel(model)
    ddp(0)
    ddp.mark_ready("w", np.full((3, 2), 2, np.float32))
    with pytest.raises(exc, match=match):
        ddp.mark_ready(param, grad)
    # the step still completes with the grads given, and the next one too
    ddp.mark_ready("b", np.full(2, 3, np.float32))
    assert ddp.reducer.steps == 1
    np.testing.assert_array_equal(model.grads["b"], [3, 3])
    np.testing.assert_array_equal(model.grads["w"], np.full((3, 2), 2))
    ddp.zero_grad()
    ddp(0)
    ddp.mark_ready(1, np.ones(2, np.float32))
    ddp.mark_ready(0, np.ones((3, 2), np.float32))
    assert ddp.reducer.steps == 2
    np.testing.assert_array_equal(model.grads["b"], [1, 1])
    ddp.close()


def test_torch_bad_input(world1):
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match="through DLPack.*dense CPU or GPU array"):
        nd.all_reduce(torch.ones(3, device="meta"))
    with pytest.raises(ConfigError, match="cannot view Tensor through DLPack"):
        nd.all_reduce(torch.ones(3).to_sparse())
    with pytest.raises(RuntimeError, match="module has no parameters"):  # torch DDP's class
        nd.DistributedDataParallel(torch.nn.ReLU())
    with pytest.raises(TypeError, match=r"parameter 0 \('weight'\) has dtype complex64"):
        nd.DistributedDataParallel(torch.nn.Linear(2, 2).to(torch.complex64))
    ddp = nd.DistributedDataParallel(torch.nn.Linear(3, 2))
    for grad, exc, match in (
        (torch.ones(2, 3), TypeError, "must be a numpy.ndarray.*torch.Tensor"),
        (np.ones(5, np.float32), ValueError, r"has shape \(5,\)"),
        (np.ones((2, 3)), TypeError, "has dtype float64"),
    ):
        with pytest.raises(exc, match=match):
            ddp.mark_ready("weight", grad)
    ddp(torch.ones(4, 3)).sum().backward()  # the step the hooks drive still completes
    assert ddp.reducer.steps == 1
    np.testing.assert_array_equal(ddp.module.weight.grad.numpy(), np.full((2, 3), 4.0))
    ddp.close()


# -- DistributedGradReducer ----------------------------------------------------------------------


def _grads():
    return [np.ones((3, 2), np.float32), np.ones(2, np.float32)]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(degree=0), ValueError, "degree must be > 0, got 0"),
        (dict(degree=-1), ValueError, "degree must be > 0"),
        (dict(degree=True), TypeError, "degree must be an int, got bool"),
        (dict(degree=2.5), TypeError, "degree.*float 2.5"),
        (dict(degree="2"), TypeError, "degree.*str '2'"),
        (dict(fusion_type=-1), ValueError, "fusion_type must be >= 0, got -1"),
        (dict(fusion_type="1"), TypeError, "fusion_type must be an int, got str"),
        (dict(fusion_type=True), TypeError, "fusion_type must be an int, got bool"),
        (dict(fusion_type=1.0), TypeError, "fusion_type must be an int"),
        (dict(fusion_type=None), TypeError, "fusion_type must be an int"),
        (dict(mean=1), TypeError, "mean must be a bool"),
        (dict(group="world"), TypeError, "group must be a ProcessGroup"),
    ],
)
def test_grad_reducer_refuses_bad_options(world1, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nd.DistributedGradReducer(_grads(), **kwargs)


@pytest.mark.parametrize(
    "params, exc, match",
    [
        (None, TypeError, "parameters must be a non-empty list"),
        ([], TypeError, "parameters must be a non-empty list"),
        ([1.0], TypeError, r"parameters\[0\] has no shape/dtype"),
        ([np.ones(3, np.complex64)], TypeError, r"parameters\[0\] has dtype complex64; only floating"),
        ([np.array([1], dtype=object)], TypeError, r"parameters\[0\] has dtype object"),
        ([np.ones(3, np.int32)], TypeError, "dtype int32"),
    ],
)
def test_grad_reducer_refuses_bad_parameters(world1, params, exc, match):
    with pytest.raises(exc, match=match):
        nd.DistributedGradReducer(params)


@pytest.mark.parametrize(
    "grads, exc, match",
    [
        (_grads()[:1], ValueError, "got 1 grads for 2 parameters"),
        (_grads() + _grads()[:1], ValueError, "got 3 grads for 2 parameters"),
        (_grads()[::-1], ValueError, r"grads\[0\]: shape differs: the grad has \(2,\), its parameter"),
        (
            [np.ones((3, 2)), np.ones(2, np.float32)],
            ValueError,
            r"grads\[0\]: dtype differs: the grad is float64, its parameter float32",
        ),
        (None, TypeError, "grads must be a list or tuple"),
        ({"a": 1}, TypeError, "grads must be a list or tuple, got dict"),
        ([[1.0], np.ones(2, np.float32)], TypeError, r"grads\[0\] is a builtins.list"),
    ],
)
def test_grad_reducer_refuses_bad_grads_and_still_works(world1, grads, exc, match):
    reducer = nd.DistributedGradReducer(_grads(), degree=2)
    with pytest.raises(exc, match=match):
        reducer(grads)
    out = reducer(_grads())
    np.testing.assert_array_equal(out[1], [0.5, 0.5])
    reducer.close()


# -- two ranks -----------------------------------------------------------------------------------


def _expect(fn, exc, match_all):
    try:
        fn()
    except exc as e:
        missing = [m for m in match_all if m not in str(e)]
        assert not missing, f"{missing} not in: {e}"
        return
    raise AssertionError(f"{exc.__name__} not raised")


def _two_rank_cases(rank, world_size):
    r = rank
    f32 = np.float32
    nd.init_process_group("host", timeout=10)
    mismatched = [  # each leaves its group failed (like an aborted NCCL communicator)
        lambda g: nd.all_reduce(np.ones(4 + r, f32), group=g),
        lambda g: nd.all_reduce(np.ones(4, f32 if r == 0 else np.float64), group=g),
        lambda g: nd.all_reduce(np.ones(4, f32), op="sum" if r == 0 else "max", group=g),
        lambda g: (nd.all_reduce if r == 0 else nd.broadcast)(np.ones(4, f32), group=g),
    ]
    for call in mismatched:
        g = nd.new_group([0, 1])
        _expect(lambda: call(g), RankMismatchError, [f"rank {r}", "every rank must call the same"])
        _expect(
            lambda: nd.all_reduce(np.ones(2, f32), group=g), RankMismatchError, ["the group failed earlier"]
        )
        g.shutdown()
    for params, what in (
        ([np.ones(3 + r, f32)], "parameter 0: rank 0 has shape (3,) float32, rank 1 has shape (4,) float32"),
        ([np.ones(3, f32)] * (1 + r), "parameter 1: rank 0 has no such"),
    ):
        _expect(
            lambda: nd.DistributedDataParallel(params),
            RankMismatchError,
            [f"rank {r}:", what, "Every rank must wrap the same model"],
        )
    _expect(lambda: nd.DistributedDataParallel([_read_only(np.ones(3, f32))]), ValueError, ["read-only"])
    # a rejected mark_ready on one rank only: both ranks still finish the step, same numbers
    model = ArrayModule({"w": np.ones(4, f32), "b": np.zeros(2, f32)}, forward=lambda p, x: x)
    ddp = nd.DistributedDataParallel(model)
    ddp(0)
    if r == 1:
        _expect(lambda: ddp.mark_ready("b", np.ones(3, f32)), ValueError, ["shape (3,)"])
        _expect(lambda: ddp.mark_ready("x"), ReducerError, ["rank 1: unknown parameter 'x'"])
    ddp.mark_ready("b", np.full(2, r + 1, f32))
    ddp.mark_ready("w", np.full(4, 2 * (r + 1), f32))
    got = (model.grads["b"].tolist(), model.grads["w"].tolist())
    ddp.close()
    x = np.array(float(r + 1), f32)  # 0-d
    nd.all_reduce(x)
    strided = np.arange(8, dtype=f32)[::2] + r
    nd.all_reduce(strided)
    nd.destroy_process_group()
    return got, float(x), strided.tolist()


@pytest.mark.slow
def test_two_ranks_mismatches_are_named_and_nothing_is_lost():
    results = run_ranks(_two_rank_cases, 2, timeout=90)
    assert results[0] == results[1]
    (b, w), x, strided = results[0]
    assert b == [1.5, 1.5] and w == [3.0] * 4
    assert x == 3.0 and strided == [1.0, 5.0, 9.0, 13.0]


# -- the launcher --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node=0: use a positive integer or 'auto'"),
        (["--nproc-per-node", "abc", "x.py"], "'abc' is neither an integer nor 'auto'"),
        ([], "the following arguments are required: entrypoint"),
        (["--nproc-per-node", "2", "no_such_script.py"], "script 'no_such_script.py' not found"),
        (
            ["--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "{script}"],
            "multi-node job needs --master-addr",
        ),
        (["--nnodes", "2", "--master-addr", "10.0.0.1", "{script}"], "needs --master-port"),
        (["--nnodes", "0", "{script}"], "--nnodes=0: use a positive integer"),
        (["--log-dir", "{script}/sub", "{script}"], "--log-dir=.*cannot write the rank logs"),
    ],
)
def test_launcher_refuses_bad_flags_without_starting_workers(tmp_path, args, match):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('worker started')\n")
    args = [a.replace("{script}", str(script)) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in _ENV and k != "NCCL_DDP_SECRET"}
    p = subprocess.run(
        [sys.executable, "-m", "nccl_ddp.launch", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stderr
    assert re.search(match, p.stderr), p.stderr
    assert "worker started" not in p.stderr


def _bad_socket_addr(rank, world_size):
    """Rank 0 fails first and takes the store down, so rank 1 may see either error."""
    from nccl_ddp.errors import NcclDdpError

    try:
        nd.init_process_group("host", timeout=15)
    except NcclDdpError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.slow
def test_bad_socket_addr_is_named():
    res = run_ranks(_bad_socket_addr, 2, timeout=60, env={"NCCL_DDP_SOCKET_ADDR": "no-such-host.invalid"})
    kind, msg = res[0]
    assert kind == "ConfigError", msg
    assert "cannot listen for peers on 'no-such-host.invalid'" in msg
    assert "NCCL_DDP_SOCKET_ADDR" in msg
    assert res[1] is not None


# ------------------------------------------------------------------ one config per wrapper


def test_ddp_takes_a_config_and_refuses_it_beside_options(world1):
    from nccl_ddp.ddp.config import DDPConfig

    cfg = DDPConfig(bucket_cap_mb=0.5, find_unused_parameters=True)
    ddp = nd.DistributedDataParallel([np.ones(4, np.float32)], config=cfg)
    assert ddp.config is cfg
    ddp.close()
    with pytest.raises(ConfigError, match=r"either config= or the options \['static_graph'\]"):
        nd.DistributedDataParallel([np.ones(4, np.float32)], static_graph=True, config=cfg)
    with pytest.raises(ConfigTypeError, match="config must be a DDPConfig or None, got dict"):
        nd.DistributedDataParallel([np.ones(4, np.float32)], config={"static_graph": True})
    _ok(world1)


def test_grad_reducer_takes_a_frozen_config(world1):
    import dataclasses

    from nccl_ddp.ddp.config import GradReducerConfig

    cfg = GradReducerConfig(mean=False, fusion_type=0)
    reducer = nd.DistributedGradReducer([np.ones(2, np.float32)], config=cfg)
    assert reducer.config is cfg and reducer.mean is False and reducer.fusion_type == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mean = True  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"either config= or the options \['degree'\]"):
        nd.DistributedGradReducer([np.ones(2, np.float32)], degree=4, config=cfg)
    with pytest.raises(ConfigTypeError, match="degree must be an int, got bool"):
        GradReducerConfig(degree=True)
    _ok(world1)


@pytest.mark.slow
def test_torch_grad_reducer_names_the_parameter(world1):
    """Built on model.named_parameters(), messages name the parameter (before: grads[i] only,
    and a dtype-only mismatch said 'has shape')."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    reducer = nd.DistributedGradReducer(model.named_parameters())
    grads = [torch.zeros(2, 3), torch.zeros(2, dtype=torch.float64)]
    with pytest.raises(
        ConfigError,
        match=r"grad '0.bias' \(grads\[1\]\): dtype differs: the grad "
        r"is float64, its parameter float32",
    ):
        reducer(grads)
    with pytest.raises(
        TypeError,
        match=r"grads\[0\] is a numpy.ndarray \(NumPy\), but this reducer was "
        r"built on torch parameters",
    ):
        reducer([np.zeros((2, 3), np.float32), torch.zeros(2)])
    out = reducer([torch.ones(2, 3), torch.ones(2)])
    assert all(isinstance(g, torch.Tensor) for g in out)
    reducer.close()
