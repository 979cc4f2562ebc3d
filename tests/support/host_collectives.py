"""Host-backend groups between real processes for the comm tests: a group per rank on the
launcher's store, and each rank's inputs and the NumPy result every collective must match."""

from __future__ import annotations

import numpy as np

from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.comm.host.reduce import dtypes

DTYPES = dtypes()

SIZES = (0, 1, 2, 7, 1001, 3000)  # 3000 x 8 bytes spans several 4 KiB chunks
OPS = tuple(ReduceOp)


def host_group(rank, world, transport="auto", timeout=30.0, chunk_bytes=None, store=None, prefix="test"):
    from nccl_ddp.job.env import resolve_env
    from nccl_ddp.store.client import PrefixStore, connect_store

    store = store or connect_store(resolve_env(), timeout=timeout)
    g = HostProcessGroup(
        PrefixStore(store, prefix), rank, world, timeout=timeout, transport=transport, chunk_bytes=chunk_bytes
    )
    return g, store


def close_group(g, store):
    g.barrier().wait()
    g.shutdown()
    store.barrier("closing", g.size, 30)
    store.close()


def rank_data(rank, dtype, n, op):
    """Rank `rank`'s input: small values so integer sums and products do not overflow."""
    rng = np.random.default_rng([rank, n, DTYPES.index(dtype), OPS.index(op)])
    if dtype == np.bool_:
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        lo, hi = (0, 4) if dtype.kind == "u" else (-20, 21)
        if op is ReduceOp.PROD:
            lo, hi = (1, 4) if dtype.kind == "u" else (-3, 4)
        return rng.integers(lo, hi, n).astype(dtype)
    vals = rng.uniform(0.5, 1.5, n) if op is ReduceOp.PROD else rng.standard_normal(n)
    return vals.astype(dtype)


def expected_result(inputs, op, world):
    dt = inputs[0].dtype
    stack = np.stack(inputs) if inputs[0].size else np.zeros((world, 0), dt)
    if dt == np.bool_:
        return stack.any(0) if op is ReduceOp.MAX else stack.all(0)
    wide = stack.astype(np.float64) if dt.kind == "f" or dt.name == "bfloat16" else stack
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        r = wide.sum(0, dtype=wide.dtype)
    elif op is ReduceOp.PROD:
        r = wide.prod(0, dtype=wide.dtype)
    else:
        r = wide.max(0) if op is ReduceOp.MAX else wide.min(0)
    if op is ReduceOp.AVG:
        if r.dtype.kind == "f":
            r = r / world
        else:  # NCCL's rule: truncate toward zero
            r = (np.abs(r) // world) * np.sign(r)
    return r.astype(dt)


def check_result(got, want, what):
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[want.dtype.name]
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol, err_msg=what
    )
