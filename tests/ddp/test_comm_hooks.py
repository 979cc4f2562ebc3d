"""Communication hooks (`register_comm_hook`, `nccl_ddp.hooks`), DistributedGradReducer's
`compress`, and `check_finite` (DDP and the grad reducer).

fp16/bf16 compression is held to torch's `fp16_compress_hook` / `bf16_compress_hook` on the same
grads (torch DDP on gloo, same processes): bitwise on 2 ranks, where dividing by the world size
is exact and both round once per addition; on 3 ranks torch divides (by 3; in the wire dtype
after casting: two roundings) and gloo rounds after each addition, while we multiply by
float32(1/3) and round once when packing and once after the sum: there the results differ by at
most a few ulps of the dtype on the wire (float32 for plain all-reduce), which the test bounds.
Means in float16's subnormal range are held bitwise too (torch's rounding order: cast, then scale).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from counting_group import PackOnly
from mp import run_ranks
from paths import ROOT

SHAPES = [(3, 4), (5,), (2, 3)]


def _grad(rank: int, step: int, i: int, scale: float = 1.0) -> np.ndarray:
    g = np.random.default_rng(1000 * rank + 10 * step + i)
    return (g.standard_normal(SHAPES[i]) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 against torch's hooks


def _torch_grads(rank: int, hook_name: str, steps: int, scale: float = 1.0) -> list:
    """Per step, torch DDP's reduced grads with torch's hook (grads set through a linear model
    whose backward yields exactly our _grad values)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])
    module = _Sum(params)
    ddp = DistributedDataParallel(module)
    if hook_name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook_name == "bf16":
        ddp.register_comm_hook(None, torch_bf16_compress_hook())
    out = []
    for step in range(steps):
        ddp.zero_grad()
        coeffs = [torch.from_numpy(_grad(rank, step, i, scale)) for i in range(len(SHAPES))]
        ddp(coeffs).backward()
        out.append([p.grad.numpy().copy() for p in params])
    return out


def torch_bf16_compress_hook():
    """torch's bf16_compress_hook without its check for NCCL >= 2.10 (it refuses gloo; gloo
    reduces bfloat16 all the same), as scripts/bench_ddp_torch.py has it."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_ddp_torch import torch_bf16_compress_hook as hook

    return hook


def _Sum(params):
    import torch

    class Sum(torch.nn.Module):
        """loss = sum_i <coeff_i, p_i>: the grad of p_i is coeff_i."""

        def __init__(self) -> None:
            super().__init__()
            self.ps = params

        def forward(self, coeffs):
            return sum((c * p).sum() for c, p in zip(coeffs, self.ps))

    return Sum()


def _our_grads(rank: int, hook_name: str, steps: int, mode: str, state=None, scale: float = 1.0) -> list:
    import nccl_ddp as nd
    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule

    module = (
        ArrayModule([np.zeros(s, np.float32) for s in SHAPES])
        if mode == "view"
        else PackOnly([np.zeros(s, np.float32) for s in SHAPES])
    )
    ddp = nd.DistributedDataParallel(module)
    ddp.register_comm_hook(
        state() if state else None,
        hooks.allreduce if hook_name == "allreduce" else getattr(hooks, f"{hook_name}_compress"),
    )
    out = []
    for step in range(steps):
        for i in reversed(range(len(SHAPES))):
            ddp.mark_ready(i, _grad(rank, step, i, scale))
        out.append([g.copy() for g in ddp.grads])
        ddp.zero_grad()
    ddp.close()
    return out


def _whole_world():
    import nccl_ddp as nd

    return nd.new_group([0, 1, 2][: nd.get_world_size()])


def _compare_with_torch(rank: int, world: int, store_dir: str, scale: float = 1.0) -> dict:
    import torch
    from torch_oracle import gloo_group

    import nccl_ddp as nd

    torch.set_num_threads(1)
    names = ["allreduce", "fp16", "bf16"]
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        refs = {n: _torch_grads(rank, n, 3, scale) for n in names}
    nd.init_process_group("host")
    try:
        out = {}
        for n in names:
            out[(n, "view")] = _our_grads(rank, n, 3, "view", scale=scale)
            out[(n, "pack")] = _our_grads(rank, n, 3, "pack", scale=scale)
            # state = another group object: the hook runs as a plain Python hook, not fused
            out[(n, "unfused")] = _our_grads(rank, n, 3, "view", state=_whole_world, scale=scale)
        return {"refs": refs, "ours": out}
    finally:
        nd.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_compression_matches_torch_hooks(world, tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    results = run_ranks(_compare_with_torch, world, str(tmp_path), timeout=180)
    ulp = {"allreduce": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-7}
    for rank, res in enumerate(results):
        for (name, mode), ours in res["ours"].items():
            ref = res["refs"][name]
            for step, (o_step, r_step) in enumerate(zip(ours, ref)):
                for i, (o, r) in enumerate(zip(o_step, r_step)):
                    where = f"rank {rank} {name} {mode} step {step} grad {i}"
                    if world == 2:
                        np.testing.assert_array_equal(o, r, err_msg=where)
                    else:  # a few wire ulps of the largest summand (see the module doc)
                        bound = 4 * ulp[name] * float(np.abs(r).max() * world)
                        assert float(np.abs(o - r).max()) <= bound, where
    # compression did happen: fp16/bf16 differ from the float32 all-reduce
    r0 = results[0]["ours"]
    assert not np.array_equal(r0[("bf16", "view")][0][0], r0[("allreduce", "view")][0][0])


@pytest.mark.slow
def test_fp16_subnormal_means_round_as_torch(tmp_path):
    """Grads whose means fall in float16's subnormal range (|x| < 2**-14): torch's
    fp16_compress_hook rounds to float16 first and divides there; ours (fused pack, pack mode and
    the plain hook) equals it bitwise. Scaling first, then casting, differed in the last ulp."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    results = run_ranks(_compare_with_torch, 2, str(tmp_path), 2.0**-17, timeout=180)
    subnormal = 0
    for rank, res in enumerate(results):
        for (name, mode), ours in res["ours"].items():
            for step, (o_step, r_step) in enumerate(zip(ours, res["refs"][name])):
                for i, (o, r) in enumerate(zip(o_step, r_step)):
                    np.testing.assert_array_equal(
                        o, r, err_msg=f"rank {rank} {name} {mode} step {step} grad {i}"
                    )
                    if name == "fp16":
                        subnormal += int(((r != 0) & (np.abs(r) < 2.0**-14)).sum())
    assert subnormal > 100, subnormal  # the case did reach fp16's subnormal range


# ---------------------------------------------------------------------------------------------
# user hooks: the torch contract


def _user_hooks(rank: int, world: int) -> dict:
    import nccl_ddp as nd
    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule

    seen = []

    def mean_into_new_array(state, bucket):
        seen.append(
            (
                bucket.index(),
                [tuple(g.shape) for g in bucket.gradients()],
                len(bucket.parameters()),
                bucket.is_last(),
            )
        )
        buf = bucket.buffer().copy()  # reduce a copy: the reducer copies the result back
        buf *= np.float32(1.0 / world)
        return hooks.all_reduce_fut(bucket.process_group, buf).then(lambda f: f.value())

    def bad_return(state, bucket):
        return bucket.buffer()

    nd.init_process_group("host", timeout=60.0)
    try:
        out = {}
        for mode in ("view", "pack"):
            params = [np.zeros(s, np.float32) for s in SHAPES]
            module = ArrayModule(params) if mode == "view" else PackOnly(params)
            ddp = nd.DistributedDataParallel(module, bucket_cap_mb=0)
            ddp.register_comm_hook(None, mean_into_new_array)
            for i in reversed(range(len(SHAPES))):
                ddp.mark_ready(i, _grad(rank, 0, i))
            out[mode] = [g.copy() for g in ddp.grads]
            ddp.close()
        out["seen"] = seen[:3]
        ddp = nd.DistributedDataParallel(ArrayModule([np.zeros(s, np.float32) for s in SHAPES]))
        ddp.register_comm_hook(None, bad_return)
        try:
            for i in reversed(range(len(SHAPES))):
                ddp.mark_ready(i, _grad(rank, 0, i))
        except Exception as e:  # noqa: BLE001 - the test reports what was raised
            out["bad"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_user_hook_contract():
    results = run_ranks(_user_hooks, 2, timeout=60)
    expected = [(_grad(0, 0, i) + _grad(1, 0, i)) / 2 for i in range(len(SHAPES))]
    for res in results:
        for mode in ("view", "pack"):
            for g, e in zip(res[mode], expected):
                np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
        # bucket_cap_mb=0: one bucket per parameter, filled in reverse order
        assert res["seen"] == [(0, [(2, 3)], 1, False), (1, [(5,)], 1, False), (2, [(3, 4)], 1, True)]
        assert "ConfigTypeError" in res["bad"] and "bad_return returned ndarray" in res["bad"]


@pytest.mark.slow
def test_register_comm_hook_bad_use():
    from nccl_ddp.errors import ConfigError, ConfigTypeError

    results = run_ranks(_bad_registration, 1, timeout=60)[0]
    assert results == [
        "ConfigTypeError",
        "ConfigError: PythonReducer",
        "ConfigError: twice",
        "ConfigError: after a step",
    ]
    assert ConfigError and ConfigTypeError


def _bad_registration(rank: int, world: int) -> list:
    import nccl_ddp as nd
    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import ConfigError, ConfigTypeError

    nd.init_process_group("host")
    out = []
    try:

        def fresh(**kw):
            return nd.DistributedDataParallel(ArrayModule([np.zeros(s, np.float32) for s in SHAPES]), **kw)

        try:
            fresh().register_comm_hook(None, "not callable")
        except ConfigTypeError:
            out.append("ConfigTypeError")
        try:
            fresh(reducer_mode="PythonReducer").register_comm_hook(None, hooks.bf16_compress)
        except ConfigError as e:
            out.append("ConfigError: PythonReducer" if "CppReducer" in str(e) else str(e))
        ddp = fresh()
        ddp.register_comm_hook(None, hooks.bf16_compress)
        try:
            ddp.register_comm_hook(None, hooks.fp16_compress)
        except ConfigError as e:
            out.append("ConfigError: twice" if "once" in str(e) else str(e))
        ddp = fresh()
        for i in reversed(range(len(SHAPES))):
            ddp.mark_ready(i, _grad(rank, 0, i))
        try:
            ddp.register_comm_hook(None, hooks.bf16_compress)
        except ConfigError as e:
            out.append("ConfigError: after a step" if "before the first" in str(e) else str(e))
        return out
    finally:
        nd.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the timeline shows the wire dtype and bytes


def _timeline_wire(rank: int, world: int) -> list:
    import nccl_ddp as nd
    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.profiling import Timeline

    nd.init_process_group("host")
    try:
        ddp = nd.DistributedDataParallel(ArrayModule([np.zeros(s, np.float32) for s in SHAPES]))
        ddp.reducer.prof = Timeline(rank, timeline=True, nvtx=False)
        ddp.register_comm_hook(None, hooks.bf16_compress)
        for i in reversed(range(len(SHAPES))):
            ddp.mark_ready(i, _grad(rank, 0, i))
        ddp.close()
        return [ddp.reducer.layout.buckets[0].nbytes] + [
            (s.phase, s.nbytes, s.dtype) for s in ddp.reducer.prof.spans if s.phase == "allreduce"
        ]
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_timeline_shows_wire_dtype():
    f32_bytes, *spans = run_ranks(_timeline_wire, 2, timeout=60)[0]
    # one float32 bucket; on the wire in bfloat16: half its bytes
    assert spans == [("allreduce", f32_bytes // 2, "bfloat16")], spans


# ---------------------------------------------------------------------------------------------
# DistributedGradReducer(compress=...)


def _grad_reducer_compress(rank: int, world: int, compress) -> list:
    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        r = nd.DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], compress=compress)
        return [np.array(g) for g in r([_grad(rank, 0, i) for i in range(len(SHAPES))])]
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("compress,wire", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_grad_reducer_compress(compress, wire):
    from nccl_ddp.ddp.comm_hooks import compression_dtype

    dt = compression_dtype(wire)
    results = run_ranks(_grad_reducer_compress, 2, compress, timeout=60)
    for i in range(len(SHAPES)):
        # each rank packs x * 1/2 into the wire dtype; the sum is rounded once; widened back
        parts = [(_grad(r, 0, i) * np.float32(0.5)).astype(dt).astype(np.float32) for r in range(2)]
        expected = (parts[0] + parts[1]).astype(dt).astype(np.float32)
        for res in results:
            assert res[i].dtype == np.float32
            np.testing.assert_array_equal(res[i], expected)


@pytest.mark.slow
def test_grad_reducer_compress_bad_value():
    from nccl_ddp.errors import ConfigError

    run_ranks(_expect_config_error, 1, timeout=60)
    assert ConfigError


def _expect_config_error(rank: int, world: int) -> None:
    import nccl_ddp as nd
    from nccl_ddp.errors import ConfigError

    nd.init_process_group("host")
    try:
        for kw, text in (
            ({"compress": "int8"}, "compress must be one of"),
            ({"check_finite": "yes"}, "check_finite must be"),
        ):
            with pytest.raises(ConfigError, match=text):
                nd.DistributedGradReducer([np.zeros(3, np.float32)], **kw)
    finally:
        nd.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# check_finite


def _nan_step(rank: int, world: int, kind: str, check) -> dict:
    import nccl_ddp as nd
    from nccl_ddp import hooks
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import NonFiniteGradError

    def grads(step):
        gs = [_grad(rank, step, i) for i in range(len(SHAPES))]
        if step == 1 and rank == 1:
            gs[1][2] = np.nan  # parameter "b", on rank 1 only
        return gs

    nd.init_process_group("host", timeout=60.0)
    out: dict = {"finite": [], "errors": []}
    try:
        names = ["w", "b", "v"]
        if kind == "grad_reducer":
            red = nd.DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], check_finite=check)
            for step in range(3):
                try:
                    red(grads(step))
                except NonFiniteGradError as e:
                    out["errors"].append((step, str(e)))
                out["finite"].append(red.last_step_finite)
            return out
        params = {n: np.zeros(s, np.float32) for n, s in zip(names, SHAPES)}
        module = ArrayModule(params) if kind != "pack" else PackOnly(params)
        ddp = nd.DistributedDataParallel(
            module,
            check_finite=check,
            bucket_cap_mb=0,
            reducer_mode="PythonReducer" if kind == "python" else "CppReducer",
            find_unused_parameters=kind == "unused",
        )
        if kind == "bf16":
            ddp.register_comm_hook(None, hooks.bf16_compress)
        for step in range(3):
            try:
                gs = grads(step)
                for i in reversed(range(len(SHAPES))):
                    if kind == "unused" and i == 0 and step != 1:
                        continue
                    ddp.mark_ready(names[i], gs[i])
                if kind == "unused":
                    ddp.finalize()
            except NonFiniteGradError as e:
                out["errors"].append((step, str(e)))
            out["finite"].append(ddp.last_step_finite)
            ddp.zero_grad()
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["view", "pack", "python", "bf16", "unused", "grad_reducer"])
def test_check_finite_flags_every_rank(kind):
    results = run_ranks(_nan_step, 2, kind, True, timeout=60)
    for res in results:
        assert res["finite"] == [True, False, True], res
        assert res["errors"] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["view", "bf16", "grad_reducer"])
def test_check_finite_raise_names_bucket_and_parameter(kind):
    results = run_ranks(_nan_step, 2, kind, "raise", timeout=60)
    for rank, res in enumerate(results):
        assert [s for s, _ in res["errors"]] == [1], res
        msg = res["errors"][0][1]
        # one check (ddp/finite_check.py) for DDP and the grad reducer: one message
        assert msg.startswith(
            f"rank {rank}: step 1 produced non-finite grads (NaN or Inf) on at "
            "least one rank: first in bucket "
        ), msg
        assert msg.endswith("skip the optimizer step and zero the grads, or lower the learning rate"), msg
        # bucket_cap_mb=0, reverse order: "v" is bucket 0, "b" bucket 1 (the grad reducer
        # fuses all three into bucket 0)
        if kind == "grad_reducer":
            assert "first in bucket 0" in msg and "1" in msg, msg
        else:
            assert "first in bucket 1" in msg and "1 ('b')" in msg, msg
        assert res["finite"] == [True, False, True]


@pytest.mark.slow
def test_check_finite_off_refuses_last_step_finite():
    out = run_ranks(_finite_off, 1, timeout=60)[0]
    for owner in ("DistributedDataParallel", "DistributedGradReducer"):
        assert out[owner] == (
            "ConfigError",
            f'rank 0: last_step_finite needs check_finite=True (or "raise") when the {owner} is built',
        ), out


def _finite_off(rank: int, world: int) -> dict:
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import NcclDdpError

    nd.init_process_group("host")
    out = {}
    try:
        for owner in (
            nd.DistributedDataParallel(ArrayModule([np.zeros(3, np.float32)])),
            nd.DistributedGradReducer([np.zeros(3, np.float32)]),
        ):
            try:
                _ = owner.last_step_finite
                out[type(owner).__name__] = "no error"
            except NcclDdpError as e:
                out[type(owner).__name__] = (type(e).__name__, str(e))
        return out
    finally:
        nd.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the CUDA path, on the fake CuPy (tests/support/_fake_cupy.py: the kernels run on the CPU simulator)


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["bf16", "fp16", None])
def test_cuda_path_compression_and_check_finite(monkeypatch, hook):
    """View mode on the CUDA device: a float32 bucket is packed into the wire dtype with the 1/2
    scale by the kernel, all-reduced (a no-op here: rank 0 of a counting group of 2), unpacked
    widened back; check_finite's flag comes from the kernel (no in-place pack: the simulator
    rejects a pack whose source aliases its destination)."""
    import collections
    import sys

    import _fake_cupy
    from _fake_cupy import FakeCupy
    from counting_group import CountingGroup

    from nccl_ddp import device as D
    from nccl_ddp import hooks
    from nccl_ddp.ddp.comm_hooks import compression_dtype
    from nccl_ddp.ddp.config import DDPConfig
    from nccl_ddp.ddp.reducer import Reducer
    from nccl_ddp.kernels import cuda as ck

    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    record = _fake_cupy.FakeEvent.record

    def record_done(ev, stream=None):  # the simulator runs kernels at launch: done at once
        out = record(ev, stream)
        ev.done = True
        return out

    monkeypatch.setattr(_fake_cupy.FakeEvent, "record", record_done)
    counts: collections.Counter = collections.Counter()
    sizes = [12, 5, 6]
    params = [cp.asarray(np.ones(n, np.float32)) for n in sizes]
    grads = [cp.zeros(n, dtype=np.float32) for n in sizes]
    r = Reducer(
        params,
        grads,
        CountingGroup(counts),
        D.CudaDevice(0),
        DDPConfig(check_finite=True),
        install=lambda i, view: None,
    )
    if hook:
        r.set_comm_hook(None, getattr(hooks, f"{hook}_compress"))
    wire = {"bf16": compression_dtype("bfloat16"), "fp16": np.float16, None: np.float32}[hook]
    for step in range(2):
        values = [_grad(0, step, i) for i in range(3)]
        if step == 1:
            values[1][3] = np.inf
        for i in reversed(range(3)):
            r.grads[i].host()[...] = values[i].reshape(-1)
            r.mark_ready(i)
        for i in range(3):
            expected = (values[i] * np.float32(0.5)).astype(wire).astype(np.float32)
            np.testing.assert_array_equal(r.grads[i].get(), expected.reshape(-1))
        assert r.last_step_finite is (step == 0)
        r.zero_grad()
    assert counts["all_reduce"] == 4  # one bucket + the flags, per step


def test_hooks_module_names_each_object_once():
    """`nccl_ddp.hooks` exports one name per object (no torch-style `*_hook` aliases beside the
    short names) and every public name it holds is exported."""
    from nccl_ddp import hooks

    public = {n for n in vars(hooks) if not n.startswith("_")}
    assert public == set(hooks.__all__)
    assert len({id(getattr(hooks, n)) for n in hooks.__all__}) == len(hooks.__all__) == 8
