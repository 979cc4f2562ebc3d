import dataclasses

import numpy as np
import pytest

from nccl_ddp.buckets.layout import MiB, ParamSpec, aligned, assign_buckets

F32, F64, F16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)


def specs_of(*pairs):
    return [ParamSpec(tuple(s), np.dtype(d)) for s, d in pairs]


def test_first_bucket_1mib_then_cap_in_reverse_order():
    # 8 params of 0.5 MiB float32: first bucket closes at 1 MiB (2 params), then 2 MiB buckets.
    specs = specs_of(*[((MiB // 8,), F32)] * 8)
    layout = assign_buckets(specs, cap_bytes=2 * MiB, first_cap_bytes=MiB)
    assert [b.params for b in layout.buckets] == [(7, 6), (5, 4, 3, 2), (1, 0)]
    assert layout.locate(3) == (1, 2)


def test_grouped_by_dtype_and_ordered_by_first_member():
    specs = specs_of(((4,), F32), ((4,), F64), ((4,), F32), ((4,), F16))
    layout = assign_buckets(specs)
    assert [(b.dtype, b.params) for b in layout.buckets] == [(F16, (3,)), (F32, (2, 0)), (F64, (1,))]


def test_offsets_are_16_byte_aligned_and_padded():
    specs = specs_of(((3,), F32), ((5,), F16), ((1,), F64), ((7,), F16))
    layout = assign_buckets(specs)
    for b in layout.buckets:
        item = b.dtype.itemsize
        assert all(o * item % 16 == 0 for o in b.offsets)
        assert b.padded * item % 16 == 0 and b.padded >= b.numel
        ends = [o + n for o, n in zip(b.offsets, b.numels)]
        assert all(e <= nxt for e, nxt in zip(ends, b.offsets[1:]))
    f16 = next(b for b in layout.buckets if b.dtype == F16)
    assert f16.params == (3, 1) and f16.offsets == (0, 8) and f16.padded == 16
    assert aligned(1, F64) == 2 and aligned(9, F16) == 16


def test_align_bytes_64_for_consumers_that_need_it():
    specs = specs_of(((3,), F32), ((5,), F16), ((1,), F64), ((7,), F16), ((16,), F32))
    layout = assign_buckets(specs, align_bytes=64)
    for b in layout.buckets:
        item = b.dtype.itemsize
        assert all(o * item % 64 == 0 for o in b.offsets) and b.padded * item % 64 == 0
    f16 = next(b for b in layout.buckets if b.dtype == F16)
    assert f16.offsets == (0, 32) and f16.padded == 64
    for bad in (8, 24, 0):
        with pytest.raises(ValueError, match="align_bytes"):
            assign_buckets(specs, align_bytes=bad)


def test_cap_zero_gives_one_bucket_per_param():
    layout = assign_buckets(specs_of(*[((10,), F32)] * 3), cap_bytes=0, first_cap_bytes=0)
    assert [b.params for b in layout.buckets] == [(2,), (1,), (0,)]


def test_rebuild_follows_order_and_exclude():
    specs = specs_of(*[((MiB // 8,), F32)] * 6)
    layout = assign_buckets(specs, 2 * MiB, MiB, order=[0, 2, 4, 1, 3, 5], exclude=[3])
    assert [b.params for b in layout.buckets] == [(0, 2), (4, 1, 5)]
    assert layout.locate(3) is None and layout.num_params == 6
    # the reverse map the reducer and the MindSpore graph read: each param's bucket (-1: none)
    assert layout.bucket_of == (0, 1, 0, -1, 1, 1) and layout.unbucketed == (3,)
    assert [layout.locate(p) for p in (0, 1, 2, 4, 5)] == [(0, 0), (1, 1), (0, 1), (1, 0), (1, 2)]


def test_keys_never_share_a_bucket():
    specs = [ParamSpec((4,), F32, key=k) for k in (1, 2, 1, 2)]
    layout = assign_buckets(specs)
    assert sorted(b.params for b in layout.buckets) == [(2, 0), (3, 1)]


def test_layout_is_frozen():
    layout = assign_buckets(specs_of(((4,), F32)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.buckets = ()
