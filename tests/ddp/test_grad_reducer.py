import numpy as np
import pytest
from fakegroup import FakeGroup, _Shared, run_threads

from nccl_ddp.ddp.grad_reducer import DistributedGradReducer

DT = [np.float32, np.float64, np.float16, np.float32]


def params():
    return [np.zeros((5, 3), DT[0]), np.zeros(7, DT[1]), np.zeros(4, DT[2]), np.zeros(9, DT[3])]


def grads(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(p.shape).astype(p.dtype) for p in params()]


def _reduce_rank(group, kwargs, container):
    red = DistributedGradReducer(params(), group=group, **kwargs)
    mine = grads(group.rank)
    before = [g.copy() for g in mine]
    out = red(container(mine))
    unchanged = all(np.array_equal(a, b) for a, b in zip(mine, before))
    return type(out), [np.array(o) for o in out], unchanged, [b.params for b in red.layout.buckets]


@pytest.mark.parametrize(
    "kwargs,factor",
    [
        (dict(), 1 / 3),
        (dict(mean=False), 1.0),
        (dict(degree=6), 1 / 6),
        (dict(fusion_type=0), 1 / 3),
        (dict(fusion_type=7, mean=True, degree=3), 1 / 3),
    ],
)
def test_reduces_like_numpy(kwargs, factor):
    res = run_threads(_reduce_rank, 3, kwargs, tuple)
    total = [sum(grads(r)[i].astype(np.float64) for r in range(3)) for i in range(4)]
    for kind, out, unchanged, layout in res:
        assert kind is tuple and unchanged
        for i, o in enumerate(out):
            assert o.dtype == DT[i] and o.shape == params()[i].shape
            t = dict(rtol=5e-3, atol=5e-3) if DT[i] == np.float16 else dict(rtol=1e-5)
            np.testing.assert_allclose(o, total[i] * factor, **t)
        if kwargs.get("fusion_type") == 0:
            assert layout == [(3,), (2,), (1,), (0,)]
        else:
            assert layout == [(3, 0), (2,), (1,)]


class Param(np.ndarray):
    pass


def _fusion_ids_rank(group):
    ps = [np.zeros(4, np.float32).view(Param) for _ in range(4)]
    for p, fid in zip(ps, (2, 3, 2, 0)):
        p.comm_fusion = fid
    red = DistributedGradReducer(ps, group=group)
    out = red([np.full(4, float(i + group.rank), np.float32) for i in range(4)])
    return [b.params for b in red.layout.buckets], [float(o[0]) for o in out]


def test_comm_fusion_attribute_groups_buckets():
    for layout, out in run_threads(_fusion_ids_rank, 2):
        assert layout == [(3,), (2, 0), (1,)]
        assert out == [0.5, 1.5, 2.5, 3.5]


def one_group():
    return FakeGroup(_Shared(1, 5.0), 0, 1)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(degree=True), TypeError, "degree"),
        (dict(degree=0), ValueError, "degree"),
        (dict(degree=-2), ValueError, "degree"),
        (dict(degree=2.0), TypeError, "degree"),
        (dict(mean=1), TypeError, "mean"),
        (dict(fusion_type=-1), ValueError, "fusion_type"),
        (dict(fusion_type=False), TypeError, "fusion_type"),
        (dict(group="g"), TypeError, "group"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    kwargs.setdefault("group", one_group())
    with pytest.raises(exc, match=match):
        DistributedGradReducer(params(), **kwargs)


def test_bad_parameters_and_grads():
    with pytest.raises(TypeError, match="parameters"):
        DistributedGradReducer([], group=one_group())
    red = DistributedGradReducer(params(), group=one_group())
    with pytest.raises(TypeError, match="list or tuple"):
        red(grads(0)[0])
    with pytest.raises(ValueError, match="3 grads for 4"):
        red(grads(0)[:3])
    bad = grads(0)
    bad[1] = bad[1].astype(np.float32)
    with pytest.raises(ValueError, match=r"grads\[1\].*float64"):
        red(bad)
    out = red(grads(0))
    assert isinstance(out, list)
    np.testing.assert_allclose(out[0], grads(0)[0] / 1)


def _calls_rank(group, kwargs):
    """Four calls on one reducer, every result kept; the buffers the all-reduces were handed."""
    sent = []
    all_reduce = group.all_reduce

    def spy(buf, *args, **kw):
        sent.append(buf)
        return all_reduce(buf, *args, **kw)

    group.all_reduce = spy
    red = DistributedGradReducer(params(), group=group, **kwargs)
    sent.clear()  # the construction's check
    kept = [red([g * (call + 1) for g in grads(group.rank)]) for call in range(4)]
    return kept, sent, len(red.layout.buckets)


@pytest.mark.parametrize("kwargs", [dict(), dict(compress="fp16"), dict(check_finite=True)])
def test_buffers_reused_results_kept(kwargs):
    """The all-reduce buffers are the same at every call (group.zeros, made once); each call's
    grads are copied out of them: a later call never overwrites an earlier call's results."""
    total = [sum(grads(r)[i].astype(np.float64) for r in range(2)) / 2 for i in range(4)]
    for kept, sent, nbuckets in run_threads(_calls_rank, 2, kwargs):
        if kwargs.get("check_finite"):  # each call's last all-reduce: its non-finite flags
            sent = [b for i, b in enumerate(sent) if (i + 1) % (nbuckets + 1)]
        assert len(sent) == 4 * nbuckets
        assert all(sent[c * nbuckets + b] is sent[b] for c in range(4) for b in range(nbuckets))
        assert all(a is not b for a in kept[0] for b in kept[3])
        for call, out in enumerate(kept):
            for i, o in enumerate(out):
                t = dict(rtol=5e-3, atol=5e-3) if DT[i] == np.float16 or kwargs else dict(rtol=1e-5)
                np.testing.assert_allclose(o, total[i] * (call + 1), **t)
