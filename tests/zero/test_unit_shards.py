"""ZeRO-3's framework-free core (zero/params.py): the dim-0 cut of a unit (torch.chunk's rows,
padding past the end, one aligned flat shard per dtype), and on 3 ranks of the host backend the
all-gather that rebuilds every parameter from the shards and the reduce-scatter that averages
the grads into them; on 4 (HSDP) the partial reductions kept until an all-reduce (NumPy only)."""

import numpy as np
import pytest

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.params import unit_layout

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
SHAPES = [(7, 3), (1,), (10,), (2, 2, 2), (0, 4)]  # uneven rows, fewer rows than ranks, empty


def _specs(dtypes=(F32, F32, F64, F32, F32)):
    return [ParamSpec(s, d, name=f"p{i}") for i, (s, d) in enumerate(zip(SHAPES, dtypes))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_are_torch_chunks_and_every_row_has_one_owner(world):
    layout = unit_layout(_specs(), world)
    for i, shape in enumerate(SHAPES):
        rows = [layout.local_rows(i, r) for r in range(world)]
        assert layout.rows[i] == -(-shape[0] // world)
        assert sum(rows) == shape[0] and all(0 <= n <= layout.rows[i] for n in rows)
        b, off = layout.where(i)
        assert np.dtype(layout.shard.buckets[b].dtype) == _specs()[i].dtype
        assert off * layout.shard.buckets[b].dtype.itemsize % 16 == 0
    assert len(layout.shard.buckets) == 2  # one flat shard per dtype


def test_a_parameter_without_dimensions_is_refused_by_name():
    with pytest.raises(ConfigError, match="p0 has no dimensions"):
        unit_layout([ParamSpec((), F32, name="p0")], 2)


def _round_trip(rank, world, _):
    import nccl_ddp as nd
    from nccl_ddp.device import HostDevice
    from nccl_ddp.zero.params import ScratchPool, UnitShards

    nd.init_process_group("host")
    try:
        group, device = nd.get_world_group(), HostDevice()
        layout = unit_layout(_specs(), world, device.align_bytes)
        comm = device.new_stream()
        shards = UnitShards(
            layout, group, device, comm, ScratchPool(lambda n, dt: group.zeros(device, n, dt)), "u"
        )
        full = [
            np.arange(np.prod(s), dtype=sp.dtype) + 100 * i for i, (s, sp) in enumerate(zip(SHAPES, _specs()))
        ]
        for i, f in enumerate(full):  # this rank's rows into its shard
            lo = rank * layout.rows[i] * layout.row_numel[i]
            shards.local(i)[...] = f[lo : lo + shards.local(i).size]
        outs = [np.full(f.size, -1, f.dtype) for f in full]
        shards.start_gather(outs).synchronize(30)
        gathered = all(np.array_equal(o, f) for o, f in zip(outs, full))
        # two units sharing one gather buffer per dtype, both in flight at once (a prefetch),
        # twice: each gets its own values (the stream orders the second gather after the
        # first one's copy-out)
        pool = ScratchPool(device.empty)
        units = [
            UnitShards(layout, group, device, comm, shards.scratch, f"u{k}", gathers=pool) for k in range(2)
        ]
        for k, unit in enumerate(units):
            for i, f in enumerate(full):
                lo = rank * layout.rows[i] * layout.row_numel[i]
                unit.local(i)[...] = f[lo : lo + unit.local(i).size] * (k + 2)
        for _ in range(2):
            got = [[np.full(f.size, -1, f.dtype) for f in full] for _ in units]
            events = [unit.start_gather(o) for unit, o in zip(units, got)]
            for e in events:
                e.synchronize(30)
            gathered = gathered and all(
                np.array_equal(o, f * (k + 2)) for k, g in enumerate(got) for o, f in zip(g, full)
            )
        # on the host the rows come straight out of the peers' shards: no gather buffer at all
        no_buffer = pool.nbytes == 0
        grads = [f * (rank + 1) for f in full]
        grads[3] = None  # a missing grad reads as zeros
        event, red = shards.start_reduce(grads)
        event.synchronize(30)
        mean = (world + 1) / 2
        reduced = []
        for i, f in enumerate(full):
            lo = rank * layout.rows[i] * layout.row_numel[i]
            want = f[lo : lo + shards.local(i).size] * (0 if i == 3 else mean)
            reduced.append(np.allclose(shards.grad_local(red, i), want))
        comm.close()
        return gathered, no_buffer, reduced
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_gather_rebuilds_and_reduce_scatter_averages_on_three_ranks():
    from mp import run_ranks

    for rank, (gathered, no_buffer, reduced) in enumerate(run_ranks(_round_trip, 3, None, timeout=60)):
        assert gathered, rank
        assert no_buffer, rank
        assert all(reduced), (rank, reduced)


def _partial(rank, world, _):
    """HSDP on 4 ranks: shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}; three reductions,
    the first two with all_reduce=False."""
    import nccl_ddp as nd
    from nccl_ddp.device import HostDevice
    from nccl_ddp.zero.params import ScratchPool, UnitShards

    nd.init_process_group("host")
    try:
        all_groups = [(ranks, nd.new_group(ranks)) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
        shard, replicate = [g for ranks, g in all_groups if rank in ranks]  # (shard, replicate)
        device = HostDevice()
        layout = unit_layout(_specs(), 2, device.align_bytes)
        comm = device.new_stream()
        pool = ScratchPool(lambda n, dt: shard.zeros(device, n, dt))
        shards = UnitShards(layout, shard, device, comm, pool, "u", replicate=replicate)
        full = [np.arange(np.prod(s), dtype=sp.dtype) + 1 for s, sp in zip(SHAPES, _specs())]
        returned = []
        for k, all_reduce in enumerate((False, False, True)):
            event, red = shards.start_reduce([f * (rank + 1) * (k + 1) for f in full], all_reduce=all_reduce)
            event.synchronize(30)
            returned.append(red is not None)
        mean = np.mean([r + 1 for r in range(world)]) * (1 + 2 + 3)  # every rank's, every step's
        reduced = []
        for i, f in enumerate(full):
            lo = shard.rank * layout.rows[i] * layout.row_numel[i]
            want = f[lo : lo + shards.local(i).size] * mean
            reduced.append(np.allclose(shards.grad_local(red, i), want))
        comm.close()
        return returned, reduced, shards.partial is None
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_partial_reductions_are_kept_until_an_all_reduce_on_four_ranks():
    from mp import run_ranks

    for rank, (returned, reduced, cleared) in enumerate(run_ranks(_partial, 4, None, timeout=90)):
        assert returned == [False, False, True], rank  # no shards to install until the all-reduce
        assert all(reduced), (rank, reduced)
        assert cleared, rank
