"""The grads the reducer tests reduce (test_reducer on threads, test_ddp_mp on processes,
test_ddp_gpu on a GPU): mixed dtypes and shapes, per-rank random grads, their float64 mean, the
tolerance per dtype, and the DDP flag combinations."""

import itertools

import numpy as np

SHAPES = [
    ((33, 5), np.float32),
    ((17,), np.float64),
    ((9, 3), np.float16),
    ((130,), np.float32),
    ((4, 4), np.float64),
    ((65,), np.float16),
]


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.standard_normal(s).astype(d) for i, (s, d) in enumerate(SHAPES)}


def local_grads(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    return {f"p{i}": rng.standard_normal(s).astype(d) for i, (s, d) in enumerate(SHAPES)}


def expected_mean(size, step, keys=None):
    gs = [local_grads(r, step) for r in range(size)]
    return {k: np.mean([g[k].astype(np.float64) for g in gs], axis=0) for k in gs[0]}


def tol(dtype):
    return dict(rtol=5e-3, atol=5e-3) if np.dtype(dtype) == np.float16 else dict(rtol=1e-5, atol=1e-6)


# (average_in_collective, reducer_mode, static_graph, find_unused_parameters)
FLAGS = list(itertools.product([False, True], ["CppReducer", "PythonReducer"], [False, True], [False, True]))
