"""ZeRO-3's unit memory on the CUDA device (zero/params.py with zero/unit_kernels.py), proven on
the fake GPU: the shards come from the NCCL group's `zeros` as CuPy arrays, the all-gather and the
reduce-scatter are NCCL calls of real `NcclProcessGroup`s (1-3 ranks as threads over one fake
heap, tests/support/fake_nccl_world.py), and the copy-out and the grad pack are the real
kernels/bucket.cu compiled for the CPU (tests/support/cuda_cpu, memory checked). Every gathered
parameter, packed buffer and reduced shard is compared bit for bit with what the host path's
NumPy copies (zero/unit_copy.py `copy_out`, `pack`) compute from the same values; the stream
order (the comm stream waits for the compute stream, then collective and kernel in turn on the
comm stream, then its done event) is read from the fake's log."""

import functools

import _fake_cupy
import ml_dtypes
import numpy as np
import pytest
from fake_nccl_world import run_mesh, run_world
from kernel_checks import assert_bits_equal, fake_cupy_installed

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.device import CudaDevice
from nccl_ddp.zero import params as P
from nccl_ddp.zero import unit_copy

F32, F64, BF16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)
SHAPES = [(7, 3), (1,), (10,), (2, 2, 2), (0, 4), (5,)]  # uneven rows, fewer rows than ranks, empty


@pytest.fixture
def cp(monkeypatch):
    """The fake CuPy, its events reached when recorded (it runs every launch when made), and a
    log of the launches, memsets, allocations, stream waits and event records in order."""
    fake = fake_cupy_installed(monkeypatch)
    fake.log = []
    call, wait, record = (
        _fake_cupy.FakeFunction.__call__,
        _fake_cupy.FakeStream.wait_event,
        _fake_cupy.FakeEvent.record,
    )

    def launch(self, grid, block, args, shared_mem=0, stream=None):
        fake.log.append(("launch", self.name, (stream or _fake_cupy.FAKE_STATE["current"]).ptr))
        return call(self, grid, block, args, shared_mem, stream)

    def waits(self, event):
        fake.log.append(("wait", self.ptr, event.on_ptr))
        return wait(self, event)

    def records(self, stream=None):
        record(self, stream)
        self.done = True
        fake.log.append(("record", self.on_ptr))

    memset, empty = fake._memset, fake.empty

    def alloc(*a, **kw):  # on which stream CuPy's pool would tie the memory
        fake.log.append(("alloc", _fake_cupy.FAKE_STATE["current"].ptr))
        return empty(*a, **kw)

    fake.empty = fake.zeros = alloc
    monkeypatch.setattr(_fake_cupy.FakeFunction, "__call__", launch)
    monkeypatch.setattr(_fake_cupy.FakeStream, "wait_event", waits)
    monkeypatch.setattr(_fake_cupy.FakeEvent, "record", records)
    monkeypatch.setattr(
        fake, "_memset", lambda ptr, v, n, s: (fake.log.append(("memset", s)), memset(ptr, v, n, s))
    )
    return fake


def _specs(dtypes):
    return [ParamSpec(s, np.dtype(d), name=f"p{i}") for i, (s, d) in enumerate(zip(SHAPES, dtypes))]


def _full(specs):
    """Every parameter's full values: small integers, exact in every dtype and in any sum."""
    return [
        (np.arange(int(np.prod(s.shape)), dtype=np.float64) % 17 + 3 * i).astype(s.dtype)
        for i, s in enumerate(specs)
    ]


def _host_shard(layout, full, rank, b):
    """Rank `rank`'s flat shard b as the host path holds it (its rows, zero padding)."""
    bucket = layout.shard.buckets[b]
    shard = np.zeros(bucket.padded, bucket.dtype)
    for i, off in zip(bucket.params, bucket.offsets):
        lo, n = layout.rank_rows(i)[rank]
        shard[off : off + n] = full[i][lo : lo + n]
    return shard


def _round_trip(cp, rank, group, *, specs, reduce_dtype, grads_dtype=None):
    device = CudaDevice(0)
    layout = P.unit_layout(specs, group.size, device.align_bytes)
    comm = device.new_stream()
    scratch = P.ScratchPool(functools.partial(group.zeros, device))
    shards = P.UnitShards(layout, group, device, comm, scratch, "u")
    full = _full(specs)
    for b in range(len(layout.shard.buckets)):
        shards.shards[b].host()[...] = _host_shard(layout, full, rank, b)
    outs = [cp.asarray(np.full(f.size, -1, f.dtype)) for f in full]
    mark = len(cp.log)
    event = shards.start_gather(outs)
    event.synchronize(5)
    gather_log = cp.log[mark:]
    gathered = [o.get() for o in outs]
    gdt = [grads_dtype[i % len(grads_dtype)] if grads_dtype else f.dtype for i, f in enumerate(full)]
    grads_np = [None if i == 3 else (f * (rank + 1)).astype(gdt[i]) for i, f in enumerate(full)]
    grads = [None if g is None else cp.asarray(g) for g in grads_np]
    stale = [cp.asarray((f * 0 + 5).astype(gdt[i])) for i, f in enumerate(full)]  # fills the scratch
    shards.start_reduce(stale, reduce_dtype)[0].synchronize(5)
    mark = len(cp.log)
    event, red = shards.start_reduce(grads, reduce_dtype)
    event.synchronize(5)
    packs = [
        scratch.get(
            bucket.padded * layout.world, bucket.dtype if reduce_dtype is None else reduce_dtype
        ).get()
        for bucket in layout.shard.buckets
    ]
    return {
        "layout": layout,
        "full": full,
        "gathered": gathered,
        "grads": grads_np,
        "packs": packs,
        "reduced": [shards.grad_local(red, i).get() for i in range(len(specs))],
        "shards_type": {type(s).__name__ for s in shards.shards},
        "gather_log": gather_log,
        "reduce_log": cp.log[mark:],
        "comm": comm.ptr,
        "compute": device.current_stream().ptr,
    }


def _host_path(res, world, reduce_dtype):
    """What the host path's copies make of the same values: the gathered parameters (`copy_out`
    of the world's shards), each rank's packed grads (`pack`), and their average's chunk."""
    layout, full = res[0]["layout"], res[0]["full"]
    outs = [np.full(f.size, -1, f.dtype) for f in full]
    packs = []
    for b, bucket in enumerate(layout.shard.buckets):
        gathered = np.concatenate([_host_shard(layout, full, r, b) for r in range(world)])
        dims0 = [s.shape[0] for s in layout.specs]
        cuts = unit_copy.bucket_cuts(bucket.params, bucket.offsets, dims0, layout.rows, layout.row_numel)
        unit_copy.copy_out(cuts, gathered, world, outs)
        dt = bucket.dtype if reduce_dtype is None else reduce_dtype
        per_rank = []
        for r in range(world):
            pack = np.zeros(bucket.padded * world, dt)
            unit_copy.pack(cuts, pack, world, [res[r]["grads"][i] for i in bucket.params])
            per_rank.append(pack)
        packs.append(per_rank)
    return outs, packs


CASES = {
    "f32+f64": dict(specs=[F32, F32, F64, F32, F32, F64], reduce_dtype=None),
    "bf16 reduced in f32": dict(specs=[BF16] * 6, reduce_dtype=F32),  # the widening pack
    "f32 reduced in bf16": dict(specs=[F32] * 6, reduce_dtype=BF16),  # the narrowing pack
    "f64 reduced in f32": dict(specs=[F64] * 6, reduce_dtype=F32),  # no kernel: CuPy's cast
    # grads of two dtypes in one bucket (ShardedParams takes any float grads): a pack each
    "bf16 and f32 grads in f32": dict(specs=[BF16] * 6, reduce_dtype=F32, grads_dtype=[BF16, F32]),
}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_gather_pack_and_reduce_scatter_equal_the_host_path(cp, world, case):
    kw = dict(CASES[case], specs=_specs(CASES[case]["specs"]))
    res, _ = run_world(cp, world, lambda rank, group: _round_trip(cp, rank, group, **kw))
    want_outs, want_packs = _host_path(res, world, kw["reduce_dtype"])
    layout = res[0]["layout"]
    for rank, r in enumerate(res):
        assert r["shards_type"] == {"FakeArray"}  # the group's zeros on the (fake) GPU
        for i, (got, want, full) in enumerate(zip(r["gathered"], want_outs, r["full"])):
            assert_bits_equal(got, want, f"rank {rank} p{i} gathered")
            assert_bits_equal(got, full, f"rank {rank} p{i} == its full value")
        for b, got in enumerate(r["packs"]):
            assert_bits_equal(got, want_packs[b][rank], f"rank {rank} bucket {b} packed")
        for i, got in enumerate(r["reduced"]):
            b, off = layout.where(i)
            n = layout.shard.buckets[b].padded
            mean = sum(p.astype(np.float64) for p in want_packs[b]) / world
            want = mean[rank * n + off : rank * n + off + got.size].astype(got.dtype)
            assert_bits_equal(got, want, f"rank {rank} p{i} reduced")
            if i == 3:
                assert not np.any(got.astype(np.float64)), "a missing grad reduces as zeros"


def _on(comm, log):
    """The entries of `log` on stream `comm`: its waits, launches, memsets, records, collectives."""
    return [e for e in log if comm in e[1:] and not (e[0] == "wait" and e[2] == comm)]


def _name(e):
    return e[1].split("<")[0] if e[0] == "launch" else e[0]


def test_the_comm_stream_orders_collectives_and_kernels_one_launch_per_bucket(cp):
    kw = dict(specs=_specs([F32, F32, F64, F32, F32, F64]), reduce_dtype=None)
    res, world = run_world(cp, 2, lambda rank, group: _round_trip(cp, rank, group, **kw), log=cp.log)
    for r in res:
        comm, compute = r["comm"], r["compute"]
        assert comm != compute
        buckets = len(r["layout"].shard.buckets)
        # compute ─●─────────────────────────────────────────────────
        # comm      └wait─[all-gather b]─[copy out b: 1 unpack]─...─●done
        # (the gathered buffer allocated with the comm stream current: freed in its order)
        gather = [e for e in _on(comm, r["gather_log"]) if e[0] != "record"]
        assert gather[0] == ("wait", comm, compute), gather
        assert [_name(e) for e in gather[1:]] == ["alloc", "allGather", "nd_unpack_small"] * buckets, gather
        assert _on(comm, r["gather_log"])[-1] == ("record", comm)
        # compute ─●───────────────────────────────────────────────────
        # comm      └wait─[zero | pack b: 1 launch]─[reduce-scatter b]─...─●done
        red = [e for e in _on(comm, r["reduce_log"]) if e[0] != "record"]
        assert red[0] == ("wait", comm, compute), red
        # (the scratch, filled by an earlier reduce, is reused; the reduced shard is allocated)
        assert [_name(e) for e in red[1:]] == [
            "alloc",
            "memset",
            "nd_pack_small",
            "reduceScatter",
        ] * buckets, red
        assert _on(comm, r["reduce_log"])[-1] == ("record", comm)
    nccl = [e for e in world.log if e[0] in ("allGather", "reduceScatter")]
    assert {e[2] for e in nccl} == {r["comm"] for r in res}  # each rank's on its own comm stream


def test_the_widening_pack_is_three_launches_per_bucket(cp):
    kw = dict(specs=_specs([BF16] * 6), reduce_dtype=F32)
    (r,), _ = run_world(cp, 1, lambda rank, group: _round_trip(cp, rank, group, **kw))
    names = [_name(e) for e in r["reduce_log"] if e[0] in ("launch", "memset")]
    assert names == ["memset", "nd_pack_small", "nd_unpack_small"]


def test_the_gathered_buffer_is_freed_in_the_comm_streams_order_under_the_async_pool(monkeypatch):
    """Under CuPy's MemoryAsyncPool a buffer is freed on the stream current at its allocation
    (while that stream lives): the gathered buffer, read by the copy-out on the comm stream, is
    allocated with the comm stream current, so its free cannot overtake that read (the fake
    records every free that could: `hazards`). Nothing here waits for an event."""
    import gc
    import sys

    from fake_nccl import wait_for
    from kernel_checks import cpu_or_skip

    from nccl_ddp.kernels import cuda as ck

    cpu_or_skip()
    fake = _fake_cupy.FakeCupy(async_pool=True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_BACKEND", ck.CudaKernels(fake))
    specs = _specs([F32, F32, F64, F32, F32, F64])

    def gather(rank, group):
        device = CudaDevice(0)
        layout = P.unit_layout(specs, group.size, device.align_bytes)
        scratch = P.ScratchPool(functools.partial(group.zeros, device))
        comm = device.new_stream()
        shards = P.UnitShards(layout, group, device, comm, scratch, "u")
        outs = [fake.zeros(int(np.prod(s.shape)), s.dtype) for s in specs]
        shards.start_gather(outs)
        wait_for(lambda: not group._pending)  # the NCCL work no longer holds the buffer
        gc.collect()
        return list(fake.frees), comm.ptr

    ((frees, comm),), _ = run_world(fake, 1, gather)
    assert fake.hazards == []
    assert (len([f for f in frees if f[1] == comm]), len(frees)) == (2, 2)  # one per bucket, on comm


def test_hsdp_averages_over_the_replicas_and_defers_the_all_reduce(cp):
    """A (2 replicas, 2 shards) mesh: the shards are reduce-scattered in the shard group, then
    all-reduced over the replicate group on the same comm stream; with `all_reduce=False` a
    backward's shards are kept (None returned) and added in by the next one's all-reduce (an
    accumulating unpack). Every rank's shard is the mean of the 4 ranks' grads, summed over the
    two backwards."""
    specs = _specs([F32, F32, F64, F32, F32, F64])
    rows = cols = 2

    def grads_of(rank, step):
        return [(f * (rank + 1) + step).astype(f.dtype) for f in _full(specs)]

    def hsdp(rank, shard, replicate):
        device = CudaDevice(0)
        layout = P.unit_layout(specs, cols, device.align_bytes)
        scratch = P.ScratchPool(functools.partial(shard.zeros, device))
        shards = P.UnitShards(layout, shard, device, device.new_stream(), scratch, "u", replicate=replicate)
        grads = [[cp.asarray(g) for g in grads_of(rank, step)] for step in range(2)]
        event, kept = shards.start_reduce(grads[0], all_reduce=False)
        event.synchronize(5)
        event, red = shards.start_reduce(grads[1])
        event.synchronize(5)
        return kept, layout, [shards.grad_local(red, i).get() for i in range(len(specs))]

    res = run_mesh(cp, rows, cols, hsdp)
    for rank, (kept, layout, reduced) in enumerate(res):
        assert kept is None
        c = rank % cols  # the shard rank
        for i, got in enumerate(reduced):
            want = sum(grads_of(r, s)[i].astype(np.float64) for s in range(2) for r in range(4)) / 4
            lo, n = layout.rank_rows(i)[c]
            assert_bits_equal(got, want[lo : lo + n].astype(got.dtype), f"rank {rank} p{i}")


def test_a_unit_of_many_parameters_takes_the_uploaded_table(cp):
    """Over 32 (parameter, rank) segments the kernels read a device table uploaded on the comm
    stream instead of the by-value one (kernels/cuda.py): 20 parameters at 2 ranks, still one
    launch per bucket and the host path's values."""
    specs = [ParamSpec((3 + i % 4, 2), F32, name=f"p{i}") for i in range(20)]
    kw = dict(specs=specs, reduce_dtype=None)
    res, _ = run_world(cp, 2, lambda rank, group: _round_trip(cp, rank, group, **kw))
    want_outs, want_packs = _host_path(res, 2, None)
    for rank, r in enumerate(res):
        for i, (got, want) in enumerate(zip(r["gathered"], want_outs)):
            assert_bits_equal(got, want, f"rank {rank} p{i} gathered")
        assert_bits_equal(r["packs"][0], want_packs[0][rank], f"rank {rank} packed")
        launches = [_name(e) for e in _on(r["comm"], r["gather_log"] + r["reduce_log"]) if e[0] == "launch"]
        assert launches == ["nd_unpack", "nd_pack"], launches
