"""zero/unit_copy.py's strided copies between a unit's parameters and its rank-major shards,
against a per-rank reference loop (one slice per rank, as the layout's `local_rows` says):
uneven rows, ranks past the end with no rows, zero-size parameters, several dtypes, a missing
grad, a pack that casts, and a buffer that held other values before (the padding must be
written)."""

import numpy as np
import pytest

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.zero.params import ScratchPool, unit_layout
from nccl_ddp.zero.unit_copy import (
    bucket_cuts,
    copy_out,
    copy_out_parts,
    copy_out_strided,
    cut,
    pack,
    pack_strided,
)

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


# parameters cut along a dim > 0 (FSDP2's Shard(d)): uneven, empty last ranks, 3-D and 4-D, and
# dim-0 ones beside them in the same bucket
STRIDED = [
    ((6, 5), 1),
    ((4, 6), 1),
    ((3, 4, 2), 1),
    ((2, 3, 7), 2),
    ((7, 3), 0),
    ((2, 2, 5, 3), 2),
    ((3, 0), 1),
]


def _strided_layout(world, dtype):
    specs = [ParamSpec(s, np.dtype(dtype), name=f"p{i}") for i, (s, _) in enumerate(STRIDED)]
    return unit_layout(specs, world, dims=[d for _, d in STRIDED])


def _chunk(full, dim, rows, r):
    """torch.chunk's chunk r on `dim` (empty past the end), as a contiguous flat array."""
    size = full.shape[dim]
    lo, hi = min(r * rows, size), min((r + 1) * rows, size)
    return np.ascontiguousarray(np.take(full, np.arange(lo, hi), axis=dim)).ravel()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_strided_copies_hold_torch_chunks_per_rank(world):
    layout = _strided_layout(world, np.float32)
    (bucket,) = layout.shard.buckets
    n = bucket.padded
    rng = np.random.default_rng(world)
    fulls = [rng.integers(1, 1000, s).astype(np.float32) for s, _ in STRIDED]
    grads = [f.ravel() for f in fulls]
    grads[1] = None  # packs as zeros
    placed = list(zip(bucket.params, bucket.offsets))
    plans = [layout.strided(i, off) for i, off in placed if layout.dims[i]]
    flat = [(i, off) for i, off in placed if not layout.dims[i]]
    cuts = bucket_cuts(
        [i for i, _ in flat], [o for _, o in flat], [s[0] for s, _ in STRIDED], layout.rows, layout.row_numel
    )
    packed = np.full(n * world, 3, np.float64)  # stale values; a pack that casts
    pack(cuts, packed, world, [grads[i] for i, _ in flat])
    pack_strided(plans, packed, world, [grads[p.param] for p in plans])
    for i, off in placed:
        dim = STRIDED[i][1]
        for r in range(world):
            block = packed[r * n + off : r * n + off + layout.chunk_numel(i)]
            real = layout.local_numel(i, r)
            want = np.zeros(real) if grads[i] is None else _chunk(fulls[i], dim, layout.rows[i], r)
            assert want.size == real, (i, r)
            np.testing.assert_array_equal(block[:real], want, err_msg=f"param {i} rank {r}")
            assert not block[real:].any(), f"param {i} rank {r}: padding not zero"
    # the copy out of that buffer (as if gathered) gives back every full parameter but the None's
    outs = [np.full(f.size, -7, np.float64) for f in fulls]
    copy_out(cuts, packed, world, outs)
    copy_out_strided(plans, packed.reshape(world, -1), outs)
    for i, f in enumerate(fulls):
        want = np.zeros(f.size) if grads[i] is None else f.ravel()
        np.testing.assert_array_equal(outs[i], want, err_msg=f"param {i}")
    # and out of the ranks' shards apart (an in-place all-gather's inputs): the same
    parts = [row.copy() for row in packed.reshape(world, -1)]
    apart = [np.full(f.size, -7, np.float64) for f in fulls]
    copy_out_parts(cuts, apart, parts)
    copy_out_strided(plans, parts, apart)
    for i in range(len(fulls)):
        np.testing.assert_array_equal(apart[i], outs[i], err_msg=f"param {i} from parts")


def test_a_dim_the_parameter_lacks_is_refused():
    from nccl_ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="p0 of shape \\(4, 2\\) cannot be sharded along dim 2"):
        unit_layout([ParamSpec((4, 2), np.dtype(np.float32), name="p0")], 2, dims=[2])
