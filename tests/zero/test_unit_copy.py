"""zero/unit_copy.py's strided copies between a unit's parameters and its rank-major shards,
against a per-rank reference loop (one slice per rank, as the layout's `local_rows` says):
uneven rows, ranks past the end with no rows, zero-size parameters, several dtypes, a missing
grad, a pack that casts, and a buffer that held other values before (the padding must be
written)."""

import numpy as np
import pytest

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.zero.params import ScratchPool, unit_layout
from nccl_ddp.zero.unit_copy import bucket_cuts, copy_out, copy_out_parts, cut, pack

# uneven rows; fewer rows than ranks (the last ranks empty); a single row; empty dim 0 and row
SHAPES = [(7, 3), (2,), (10,), (3, 2, 2), (0, 4), (5, 0), (1, 5), (12, 1)]
DTYPES = [np.float32, np.float64, np.float16, np.int32]


def _layout(world, dtype):
    return unit_layout([ParamSpec(s, np.dtype(dtype), name=f"p{i}") for i, s in enumerate(SHAPES)], world)


def _cuts(layout):
    (bucket,) = layout.shard.buckets
    dims0 = [s.shape[0] for s in layout.specs]
    return bucket, bucket_cuts(bucket.params, bucket.offsets, dims0, layout.rows, layout.row_numel)


def _ref_copy_out(layout, gathered, shard_n, params, outs):
    """The reference: rank by rank, parameter by parameter."""
    for i, off in params:
        per = layout.row_numel[i]
        for r in range(layout.world):
            n = layout.local_rows(i, r) * per
            lo = r * layout.rows[i] * per
            outs[i][lo : lo + n] = gathered[r * shard_n + off : r * shard_n + off + n]


def _ref_pack(layout, packed, shard_n, params, grads):
    for (i, off), g in zip(params, grads):
        per, chunk = layout.row_numel[i], layout.chunk_numel(i)
        for r in range(layout.world):
            dst = packed[r * shard_n + off : r * shard_n + off + chunk]
            n = layout.local_rows(i, r) * per if g is not None else 0
            lo = r * layout.rows[i] * per
            dst[:n] = g[lo : lo + n] if n else dst[:0]
            dst[n:] = 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_out_matches_the_per_rank_loop(world, dtype):
    layout = _layout(world, dtype)
    bucket, cuts = _cuts(layout)
    rng = np.random.default_rng(world)
    gathered = rng.integers(1, 2000, bucket.padded * world).astype(dtype)  # never the -7 below
    params = list(zip(bucket.params, bucket.offsets))
    want = [np.full(int(np.prod(s)), -7, dtype) for s in SHAPES]
    got = [w.copy() for w in want]
    _ref_copy_out(layout, gathered, bucket.padded, params, want)
    copy_out(cuts, gathered, world, got)
    # the same rows from the shards apart (all_gather_parts: each rank's shard in place)
    apart = [w.copy() for w in got]
    for a in apart:
        a[...] = -7
    copy_out_parts(cuts, apart, [gathered[r * bucket.padded : (r + 1) * bucket.padded] for r in range(world)])
    for i, (w, g, a) in enumerate(zip(want, got, apart)):
        assert w.tobytes() == g.tobytes(), f"parameter {i} of shape {SHAPES[i]}"
        assert w.tobytes() == a.tobytes(), f"parameter {i} of shape {SHAPES[i]}, from the parts"
    # every element of a non-empty parameter came from the gather (no -7 left)
    assert all((g != -7).all() for g in got if g.size)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype,grad_dtype", [(d, d) for d in DTYPES] + [(np.float16, np.float32)])
def test_pack_matches_the_per_rank_loop(world, dtype, grad_dtype):
    layout = _layout(world, dtype)
    bucket, cuts = _cuts(layout)
    rng = np.random.default_rng(world + 10)
    grads = [(rng.standard_normal(int(np.prod(s))) * 100).astype(grad_dtype) for s in SHAPES]
    grads[2] = None  # a parameter without a grad packs as zeros
    want = np.full(bucket.padded * world, 3, dtype)  # stale values, as a reused scratch buffer
    got = want.copy()
    params = list(zip(bucket.params, bucket.offsets))
    ordered = [grads[i] for i in bucket.params]
    _ref_pack(layout, want, bucket.padded, params, ordered)
    pack(cuts, got, world, ordered)
    assert want.tobytes() == got.tobytes()


def test_the_cut_of_uneven_and_empty_parameters():
    assert cut(0, 16, 7, 2, 3) == (0, 16, 6, 3, 3)  # 4 ranks: 3 whole chunks, 1 row on the 4th
    assert cut(1, 0, 2, 1, 1) == (1, 0, 1, 2, 0)  # 3 ranks of 1 row: 2 whole, none past them
    assert cut(2, 0, 0, 0, 4) == (2, 0, 0, 0, 0)  # no rows
    assert cut(3, 0, 8, 2, 5) == (3, 0, 10, 4, 0)  # even


def test_the_scratch_pool_grows_per_dtype_and_releases():
    made = []
    pool = ScratchPool(lambda n, dt: made.append(n) or np.empty(n, dt))
    a = pool.get(100, np.float32)
    assert pool.get(80, np.float32).base is a.base and made == [100]  # a smaller one: the same memory
    assert pool.get(10, np.float64).dtype == np.float64 and made == [100, 10]
    assert pool.get(300, np.float32).size == 300 and made[-1] == 300 and pool.nbytes == 300 * 4 + 10 * 8
    pool.release()
    assert pool.nbytes == 0 and pool.get(5, np.float32).size == 5 and made[-1] == 5
