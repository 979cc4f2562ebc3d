"""The reducer's per-grad hot path does no device work: on the CUDA device (fake CuPy, see
tests/support/_fake_cupy.py) a `mark_ready` that completes no bucket makes no CUDA call at all (no stream
switch, event, allocation or launch), and each completed bucket costs the same constant number of
calls whatever its parameter count. The torch hook enters the reducer's stream scope only per
bucket. A regression that puts device work back on the per-parameter path fails here."""

import collections
import sys
import threading

import _fake_cupy
import numpy as np
import pytest
from _fake_cupy import FakeCupy
from counting_group import CountingGroup

from nccl_ddp import device as D
from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.ddp.reducer import Reducer
from nccl_ddp.kernels import cuda as ck

# calls per completed bucket in view mode, world 2 (scale by 1/2, then SUM): record the compute
# stream and make comm wait for it (1 event), scale + all-reduce submitted on comm, record done
# (1 event); a bucket's cost does not depend on how many grads it holds
PER_BUCKET = {
    "stream_enter": 2,
    "device_ctx": 6,
    "event": 2,
    "wait_event": 1,
    "alloc": 0,
    "launch": 1,
    "all_reduce": 1,
}


@pytest.fixture
def counted(monkeypatch):
    """A fake CuPy whose stream switches, device contexts, events, waits and allocations are
    counted (and whose events complete at once, so host waits return)."""
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(cp))
    counts = collections.Counter()

    def counting(cls, name, key, after=None):
        orig = getattr(cls, name)

        def wrapper(self, *a, **kw):
            counts[key] += 1
            out = orig(self, *a, **kw)
            if after:
                after(self)
            return out

        monkeypatch.setattr(cls, name, wrapper)

    counting(_fake_cupy.FakeStream, "__enter__", "stream_enter")
    counting(_fake_cupy.FakeStream, "wait_event", "wait_event")
    counting(_fake_cupy.FakeDeviceCtx, "__init__", "device_ctx")
    counting(_fake_cupy.FakeEvent, "__init__", "event")
    counting(_fake_cupy.FakeEvent, "record", "event_record", after=lambda ev: setattr(ev, "done", True))
    empty = cp.empty

    def alloc(*a, **kw):
        counts["alloc"] += 1
        return empty(*a, **kw)

    cp.empty = cp.zeros = alloc
    return cp, counts


def _reducer(cp, counts, sizes, cap_elems):
    params = [cp.asarray(np.ones(n, np.float32)) for n in sizes]
    grads = [cp.zeros(n, dtype=np.float32) for n in sizes]
    config = DDPConfig(bucket_cap_mb=cap_elems * 4 / 2**20)
    r = Reducer(params, grads, CountingGroup(counts), D.CudaDevice(0), config, install=lambda i, view: None)
    scopes = []

    class Scope:
        def __enter__(self):
            scopes.append(True)

        def __exit__(self, *exc):
            return None

    r.stream_scope = Scope
    return r, scopes


def _snapshot(cp, counts):
    c = collections.Counter(counts)
    c["launch"] = len(cp.launches)
    return c


@pytest.mark.slow
def test_per_grad_no_cuda_calls_per_bucket_constant(counted):
    cp, counts = counted
    # reverse order visit: bucket 0 = [11] (1 grad), bucket 1 = [10..7] (4), bucket 2 = [6..0] (7)
    sizes = [500] * 7 + [1000] * 4 + [4000]
    r, scopes = _reducer(cp, counts, sizes, cap_elems=4000)
    assert [len(b.params) for b in r.layout.buckets] == [1, 4, 7] and r.mode == "view"
    for i in reversed(range(len(sizes))):  # step 1: the general path, then the rebuild
        r.mark_ready(i)
    assert r.steps == 1 and [len(b.params) for b in r.layout.buckets] == [1, 4, 7]

    for step in range(2):
        del scopes[:]
        per_call = []
        for i in reversed(range(len(sizes))):
            before = _snapshot(cp, counts)
            r.mark_ready(i)
            delta = _snapshot(cp, counts) - before
            per_call.append((i, delta, len(scopes)))
            del scopes[:]
        assert r.steps == 2 + step
        launched = [(i, d, s) for i, d, s in per_call if d["all_reduce"]]
        quiet = [(i, d, s) for i, d, s in per_call if not d["all_reduce"]]
        assert [i for i, _, _ in launched] == [11, 7, 0]  # the last grad of each bucket
        for i, d, s in quiet:
            assert d == collections.Counter(), f"grad {i} made CUDA calls: {dict(d)}"
            assert s == (1 if i == len(sizes) - 1 else 0), "stream scope entered per grad"
        buckets = [{k: d[k] for k in PER_BUCKET} for _, d, _ in launched]
        assert buckets[0] == buckets[1] == PER_BUCKET, buckets  # 1 grad and 4 grads alike
        assert all(s == 1 for _, _, s in launched)
        # the last one also finalizes: the compute stream waits for each bucket's done event
        last = launched[-1][1]
        assert {k: last[k] for k in PER_BUCKET} == dict(PER_BUCKET, wait_event=1 + 3, device_ctx=6 + 3), dict(
            last
        )


@pytest.mark.slow
def test_bucket_cost_does_not_grow_with_its_grads(counted):
    """One bucket of 3 grads and one of 300: the same calls, and none per grad."""
    cp, counts = counted
    totals = []
    for n in (3, 300):
        r, _ = _reducer(cp, counts, [16] * n, cap_elems=10**6)
        assert len(r.layout.buckets) == 1
        for i in reversed(range(n)):
            r.mark_ready(i)
        before = _snapshot(cp, counts)
        for i in reversed(range(n)):
            r.mark_ready(i)
        totals.append(_snapshot(cp, counts) - before)
    assert totals[0] == totals[1], totals


def test_torch_hooks_enter_the_compute_stream_per_bucket_not_per_grad(monkeypatch):
    """On CUDA the torch adapter's compute-stream context (torch_stream_current: a CuPy stream
    switch) is what the reducer's stream scope enters. Over a backward of 16 parameters in a few
    buckets it must be entered about once per completed bucket (+ the forward, the step's first
    grad and the end-of-backward finalize), never once per grad."""
    torch = pytest.importorskip("torch")
    from fakegroup import run_threads

    import nccl_ddp as nd
    from nccl_ddp.adapters.torch import adapter as torch_adapter

    real = torch_adapter.torch_stream_current
    entered = collections.Counter()

    def counting(on_cuda):
        entered[threading.get_ident()] += 1
        return real(on_cuda)

    monkeypatch.setattr(torch_adapter, "torch_stream_current", counting)

    def body(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        ddp = nd.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.1)
        x = torch.randn(4, 64)
        for _ in range(2):
            ddp(x).sum().backward()
        me = threading.get_ident()
        before = entered[me]
        ddp(x).sum().backward()
        buckets = len(ddp.reducer.layout.buckets)
        ddp.close()
        return buckets, entered[me] - before

    for buckets, n in run_threads(body, 2):
        assert 2 <= buckets <= 5
        assert buckets <= n <= buckets + 4, (buckets, n)  # 16 grads: per grad would be >= 16
