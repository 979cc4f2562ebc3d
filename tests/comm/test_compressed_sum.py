"""The host backend's fused fp16 compression (`all_reduce_compressed`, `Float16WireSum`): on
float32 buffers, the bits of packing them into float16 with the scale, all-reducing that and
widening it back, on 2 and 3 ranks, with the buffers in shared memory (in place) and private
(staged), and on the TCP ring (each hop rounded as a float16 wire rounds it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from host_collectives import close_group, host_group
from mp import run_ranks
from shm import no_shm_leaks  # noqa: F401  (autouse: /dev/shm stays clean)

from nccl_ddp.comm.host.shm import bounds
from nccl_ddp.device import HostDevice
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.kernels.spec import pack_ref, unpack_ref

N = 200_003  # several 256 KiB pieces and 4 KiB chunks, a partial last one


def _grads(rank):
    """Every magnitude a grad has, float16's subnormals and overflow included, and inf/NaN."""
    rng = np.random.default_rng(20 + rank)
    x = (rng.standard_normal(N) * 10.0 ** rng.integers(-9, 5, N)).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, 7e4, -0.0, 65519.0]
    return x


def _through_float16(g, x, scale, shared):
    """The unfused path: pack into a float16 buffer (in shared memory: reduced in place; else
    a private one, seen for the first time: staged), all-reduce it, unpack."""
    h = g.zeros(HostDevice(), x.size, np.float16) if shared else np.empty(x.size, np.float16)
    with np.errstate(all="ignore"):
        pack_ref([x], h, [0], scale=scale)
    g.all_reduce(h).wait()
    out = np.empty(x.size, np.float32)
    unpack_ref([out], h, [0])
    return out


def _staged_formula(world, chunk_elems):
    """The staged path's result written out with NumPy's casts: every rank's input packed
    (half(float32(half(x)) / world)), each chunk's part j summed in float32 by rank j (its own
    first, then the others in rank order), rounded once to float16. (Which rank sums an element
    decides the order of a 3-rank sum: chunks of float32 hold half the elements of float16's.)"""
    with np.errstate(all="ignore"):
        qs = [
            (_grads(r).astype(np.float16).astype(np.float32) * np.float32(1 / world)).astype(np.float16)
            for r in range(world)
        ]
        qs = [q.astype(np.float32) for q in qs]
        sums = []
        for j in range(world):
            acc = qs[j].copy()
            for k in range(world):
                if k != j:
                    acc += qs[k]
            sums.append(acc.astype(np.float16).astype(np.float32))
    owner = np.empty(N, np.intp)
    for lo in range(0, N, chunk_elems):
        m = min(N, lo + chunk_elems) - lo
        for j in range(world):
            a, b = bounds(m, j, world)
            owner[lo + a : lo + b] = j
    return np.choose(owner, sums)


def _compressed_body(rank, world, transport):
    os.environ["NCCL_DDP_HOST_ADOPT"] = "0"  # private buffers staged, never given a twin: on
    g, store = host_group(rank, world, transport=transport, chunk_bytes=4096)  # 3 ranks the
    if transport != "tcp":  # path decides which rank adds an element first, so both take one
        g._transport.twins.max_bytes = 0
    dev = HostDevice()
    x, scale = _grads(rank), 1.0 / world
    refs = [_through_float16(g, x, scale, True), _through_float16(g, x, scale, False)]
    fused = transport != "tcp"
    assert g.fuses_compression(dev, "float16") is fused
    assert not g.fuses_compression(dev, "bfloat16")
    results = []
    if fused:
        shared = g.zeros(dev, N, np.float32)
        shared[...] = x
        g.all_reduce_compressed(shared, scale, "float16").wait()
        private = x.copy()
        g.all_reduce_compressed(private, scale, "float16").wait()
        results = [shared, private]
        with pytest.raises(ConfigError, match="fused bfloat16 all-reduce"):
            g.all_reduce_compressed(x.copy(), scale, "bfloat16")
        with pytest.raises(ConfigTypeError, match="takes float32 buffers, got float64"):
            g.all_reduce_compressed(x.astype(np.float64), scale, "float16")
    else:
        with pytest.raises(ConfigError, match="shm transport"):
            g.all_reduce_compressed(x.copy(), scale, "float16")
    if world > 2 and results:  # the float16 path's own staged result differs (its chunks)
        refs[1] = _staged_formula(world, 4096 // 4)
    for got, ref, what in zip(results, refs, ("shared", "private")):
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=what)
    close_group(g, store)
    return len(results)


@pytest.mark.parametrize("world,transport", [(2, "auto"), (3, "auto"), (2, "tcp")])
def test_compressed_sum_has_the_bits_of_the_float16_path(world, transport):
    assert (
        run_ranks(_compressed_body, world, transport, timeout=120) == [0 if transport == "tcp" else 2] * world
    )
