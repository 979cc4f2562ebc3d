"""The JAX adapter: DistributedGradReducer over pytrees of jax.Array, against NumPy.

- examples/train_jax_mlp.py through nccl-ddp-run (2 ranks) ends where NumPy ends when it trains
  the same MLP on the mean of both ranks' grads (backprop written out here by hand);
- a nested pytree of float32 / float16 / bfloat16 grads comes back as the same structure of
  jax.Arrays holding the per-rank mean, and the input arrays are left untouched.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install jax jaxlib)")

from mp import run_ranks  # noqa: E402
from paths import ROOT as REPO  # noqa: E402

ROOT = str(REPO)


def _example():
    path = os.path.join(ROOT, "examples", "train_jax_mlp.py")
    spec = importlib.util.spec_from_file_location("train_jax_mlp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numpy_grads(layers, x, y):
    """Grads of mean((mlp(x) - y)^2) for tanh hidden layers, by hand."""
    hs = [x]
    for w, b in layers[:-1]:
        hs.append(np.tanh(hs[-1] @ w + b))
    out = hs[-1] @ layers[-1][0] + layers[-1][1]
    d = 2.0 * (out - y) / out.size
    grads = []
    for k in range(len(layers) - 1, -1, -1):
        w = layers[k][0]
        grads.append((hs[k].T @ d, d.sum(0)))
        if k:
            d = (d @ w.T) * (1.0 - hs[k] ** 2)
    return grads[::-1]


def _numpy_training(ex, steps: int, ranks: list) -> list:
    p = ex.init_params()
    layers = [(np.asarray(la["w"], np.float64), np.asarray(la["b"], np.float64)) for la in p["layers"]]
    for step in range(steps):
        per_rank = [_numpy_grads(layers, *ex.batch(r, step)) for r in ranks]
        mean = [
            tuple(sum(g[k][j] for g in per_rank) / len(ranks) for j in range(2)) for k in range(len(layers))
        ]
        layers = [(w - ex.LR * gw, b - ex.LR * gb) for (w, b), (gw, gb) in zip(layers, mean)]
    return layers


@pytest.mark.slow
def test_jax_mlp_example_matches_numpy(tmp_path):
    saved = tmp_path / "params.npz"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            os.path.join(ROOT, "examples", "train_jax_mlp.py"),
            "--steps",
            "5",
            "--save",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sums = [
        [line for line in out.splitlines() if line.startswith(f"[rank {r}] param checksum")] for r in (0, 1)
    ]
    assert sums[0] and sums[0][0].split()[-1] == sums[1][0].split()[-1], out

    ex = _example()
    want = _numpy_training(ex, 5, [0, 1])
    alone = _numpy_training(ex, 5, [0])
    got = np.load(saved)
    for k, (w, b) in enumerate(want):
        for name, ref, solo in (("w", w, alone[k][0]), ("b", b, alone[k][1])):
            key = f"['layers'][{k}]['{name}']"
            np.testing.assert_allclose(got[key], ref, rtol=1e-4, atol=2e-6, err_msg=key)
            if name == "w":  # the test can tell averaged training from rank 0 training alone
                assert np.abs(ref - solo).max() > 1e-3


def _tree(rank: int):
    import jax.numpy as jnp

    g = np.random.default_rng(rank)
    return {
        "dense": [
            jnp.asarray(g.standard_normal((5, 3), dtype=np.float32)),
            jnp.asarray(g.standard_normal(3, dtype=np.float32)),
        ],
        "half": (jnp.asarray(g.standard_normal((4, 4)).astype(np.float16)),),
        "bf16": jnp.asarray(g.standard_normal(7, dtype=np.float32)).astype(jnp.bfloat16),
        "big": jnp.asarray(g.standard_normal((64, 64), dtype=np.float32)),
    }


def _reduce_tree(rank: int, world: int):
    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        grads = _tree(rank)
        before = jax.tree_util.tree_map(lambda a: np.array(a), grads)
        reducer = nd.DistributedGradReducer(_tree(0), mean=True)
        out = reducer(grads)
        same_structure = jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(grads)
        all_jax = all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(out))
        untouched = all(
            np.array_equal(np.array(a), b)
            for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(before))
        )
        result = jax.tree_util.tree_map(lambda a: np.array(a.astype(np.float32)), out)
        dtypes = [str(x.dtype) for x in jax.tree_util.tree_leaves(out)]
        reducer.close()
    finally:
        nd.destroy_process_group()
    return same_structure, all_jax, untouched, result, dtypes


@pytest.mark.slow
def test_grad_reducer_on_pytree():
    results = run_ranks(_reduce_tree, 2, timeout=90)
    trees = [jax.tree_util.tree_map(lambda a: np.array(a.astype(np.float32)), _tree(r)) for r in (0, 1)]
    want = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *trees)
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}
    for same_structure, all_jax, untouched, result, dtypes in results:
        assert same_structure and all_jax and untouched
        assert dtypes == [str(x.dtype) for x in jax.tree_util.tree_leaves(_tree(0))]
        for got, ref, dt in zip(jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(want), dtypes):
            np.testing.assert_allclose(got, ref, rtol=tol[dt], atol=tol[dt])
    for a, b in zip(jax.tree_util.tree_leaves(results[0][3]), jax.tree_util.tree_leaves(results[1][3])):
        np.testing.assert_array_equal(a, b)


def _odd_tree(rank: int, call: int):
    """Leaves whose byte sizes are not multiples of 64 (so only 64-byte offsets keep them
    aligned), a scalar, float16 and bfloat16."""
    import jax.numpy as jnp

    g = np.random.default_rng(100 * call + rank)
    return {
        "w": jnp.asarray(g.standard_normal((5, 3), dtype=np.float32)),
        "s": jnp.asarray(np.float32(g.standard_normal())),
        "h": jnp.asarray(g.standard_normal(9).astype(np.float16)),
        "bf": jnp.asarray(g.standard_normal(13, dtype=np.float32)).astype(jnp.bfloat16),
        "d": jnp.asarray(g.standard_normal(7, dtype=np.float32)),
    }


def _as_f64(tree):
    return jax.tree_util.tree_map(lambda a: np.array(a.astype(np.float32), np.float64), tree)


def _zero_copy_rank(rank: int, world: int):
    import gc

    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        reducer = nd.DistributedGradReducer(_odd_tree(0, 0), mean=True)
        allocated = []
        device_empty = reducer.device.empty

        def recording_empty(n, dtype):  # the call's bucket buffers
            buf = device_empty(n, dtype)
            allocated.append(buf)
            return buf

        reducer.device.empty = recording_empty
        results, pointers_inside = [], []
        for call in range(2):
            allocated.clear()
            out = reducer(_odd_tree(rank, call))
            spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in allocated]
            pointers_inside.append(
                [
                    any(lo <= leaf.unsafe_buffer_pointer() < hi for lo, hi in spans)
                    for leaf in jax.tree_util.tree_leaves(out)
                ]
            )
            results.append((out, _as_f64(out), list(allocated)))
        first, first_values, first_buffers = results[0]
        del results[1]
        gc.collect()  # the leaves alone must keep their buckets alive
        after_second = _as_f64(first)
        # the proof by mutation (never done by the library): writing into call 1's bucket shows
        # through call 1's leaves
        for buf in first_buffers:
            buf[...] = 0
        leaves_after_write = [np.array(leaf.astype(np.float32)) for leaf in jax.tree_util.tree_leaves(first)]
        reducer.close()
    finally:
        nd.destroy_process_group()
    return first_values, after_second, pointers_inside, leaves_after_write


@pytest.mark.slow
def test_reduced_leaves_alias_fresh_buckets_and_never_change():
    results = run_ranks(_zero_copy_rank, 2, timeout=90)
    want = jax.tree_util.tree_map(
        lambda a, b: (a + b) / 2, _as_f64(_odd_tree(0, 0)), _as_f64(_odd_tree(1, 0))
    )
    tol = {"w": 1e-6, "s": 1e-6, "d": 1e-6, "h": 1e-3, "bf": 1e-2}
    for first_values, after_second, pointers_inside, leaves_after_write in results:
        for key, ref in want.items():
            np.testing.assert_allclose(first_values[key], ref, rtol=tol[key], atol=tol[key], err_msg=key)
            # the second call (other grads, same reducer) left the first call's results alone
            np.testing.assert_array_equal(after_second[key], first_values[key], err_msg=key)
        # every leaf of both calls is a view into that call's own bucket buffers (no copy)
        assert pointers_inside == [[True] * 5, [True] * 5]
        assert all(not np.any(leaf) for leaf in leaves_after_write)


def _reduce_inside_jit(rank: int, world: int) -> tuple:
    import jax.numpy as jnp

    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        reducer = nd.DistributedGradReducer(_tree(0), mean=True)

        @jax.jit
        def step(grads):  # a whole jitted step: scale, reduce, use the result
            return jax.tree_util.tree_map(lambda g: g * 2, reducer(grads))

        inside = [jax.block_until_ready(step(_tree(rank))) for _ in range(2)]
        outside = reducer(_tree(rank))
        # the grads of the same jitted step, as numbers: 2 * mean over the ranks
        inside = [jax.tree_util.tree_map(lambda a: np.array(a.astype(jnp.float32)), t) for t in inside]
        outside = jax.tree_util.tree_map(lambda a: np.array(a.astype(jnp.float32)) * 2, outside)
        reducer.close()
    finally:
        nd.destroy_process_group()
    return inside, outside


@pytest.mark.slow
def test_grad_reducer_inside_jit_matches_outside():
    """Inside jax.jit the reducer is an ordered io_callback: each call of the jitted step
    all-reduces (twice here, same results) and gives the reduction outside jit, on every rank,
    dtypes included (before: ConfigError, reduce outside jit)."""
    results = run_ranks(_reduce_inside_jit, 2, timeout=90)
    tol = {"dense": 1e-6, "big": 1e-6, "half": 2e-3, "bf16": 2e-2}
    want = jax.tree_util.tree_map(
        lambda a, b: np.array(a.astype(np.float32)) + np.array(b.astype(np.float32)), _tree(0), _tree(1)
    )
    for inside, outside in results:
        for tree in inside:
            for key in tol:
                for got, ref, ref2 in zip(
                    jax.tree_util.tree_leaves(tree[key]),
                    jax.tree_util.tree_leaves(outside[key]),
                    jax.tree_util.tree_leaves(want[key]),
                ):
                    np.testing.assert_array_equal(got, ref, err_msg=key)
                    np.testing.assert_allclose(got, ref2, rtol=tol[key], atol=tol[key])


def _structure_and_leaves(rank: int, world: int) -> list:
    import jax.numpy as jnp
    import torch

    import nccl_ddp as nd

    nd.init_process_group("host")
    errors = []
    try:
        params = _tree(0)
        reducer = nd.DistributedGradReducer(params)
        renamed = _tree(rank)
        renamed["big2"] = renamed.pop("big")
        for bad in (
            {"params": _tree(rank)},  # flax's wrapper
            renamed,  # a renamed key
            jax.tree_util.tree_leaves(_tree(rank)),  # a flat list
            dict(_tree(rank), bf16=_tree(rank)["bf16"].astype(jnp.float32)),  # dtype
            dict(_tree(rank), dense=[np.asarray(x) for x in _tree(rank)["dense"]]),
            dict(_tree(rank), dense=[_tree(rank)["dense"][0]]),
        ):  # a missing leaf
            try:
                reducer(bad)
                errors.append(None)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        for built_on, grads in (
            ([np.zeros(3, np.float32)], [jnp.ones(3)]),
            ([torch.zeros(3)], [jnp.ones(3)]),
        ):
            try:
                nd.DistributedGradReducer(built_on)(grads)
                errors.append(None)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        reducer.close()
    finally:
        nd.destroy_process_group()
    return errors


@pytest.mark.slow
def test_grads_of_another_structure_or_framework_are_refused_naming_the_leaf():
    """Before: the flax wrapper, a renamed key and a flat list were accepted and the output
    took the grads' structure; NumPy leaves said "grads must be a list or tuple, got dict";
    JAX grads came back from a NumPy or torch reducer as JAX arrays without a word."""
    pytest.importorskip("torch")
    (errors,) = run_ranks(_structure_and_leaves, 1, timeout=60)
    wrapper, renamed, flat, dtype, numpy_leaf, missing, jax_to_numpy, jax_to_torch = errors
    assert "grads have key ['params']['bf16'] where the parameters have ['bf16']" in wrapper
    assert "pass grads['params']" in wrapper
    assert "grads have key ['big2'] where the parameters have ['big']" in renamed
    assert "grads have key [0] where the parameters have ['bf16']" in flat
    assert dtype.startswith(
        "ConfigError: grad ['bf16']: dtype differs: the grad is float32, its parameter bfloat16"
    )
    assert numpy_leaf.startswith(
        "ConfigTypeError: grad ['dense'][0] is a numpy.ndarray (NumPy), but this reducer was built on JAX "
        "parameters"
    )
    assert "the grads lack the parameters' key ['dense'][1]" in missing
    assert "grads[0] is a jaxlib" in jax_to_numpy and "(JAX)" in jax_to_numpy
    assert "built on NumPy parameters" in jax_to_numpy
    assert "grads[0] is a jaxlib" in jax_to_torch and "built on torch parameters" in jax_to_torch
