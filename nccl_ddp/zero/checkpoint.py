"""Checkpoints of a sharded optimizer: consolidate the ranks' shard states into the state an
unsharded optimizer would hold, and cut such a state into any world size's shards.

Framework-free: a piece's state is {key: 1-D array of the piece's length (elementwise state, e.g.
Adam's exp_avg) or a float (per-parameter scalar, e.g. its step)}. Consolidation is collective:
the key names are agreed (an all-gather of their list), elementwise state moves by one all-gather
per bucket and key, the scalars by one all-reduce, taken from the rank that owns each parameter's
first element. Resharding is local: every rank slices the full state it loaded.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Optional

import numpy as np

from nccl_ddp.buckets.memory import to_host
from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.device import Stream
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.layout import ShardLayout
from nccl_ddp.zero.shards import ZeroShards

PieceState = Dict[str, Any]  # key -> 1-D array (elementwise) or float (scalar)
FullState = Dict[int, Dict[str, Any]]  # param -> key -> flat array of the param's numel or float
_KEYS_BYTES = 4096


def consolidate(
    shard_memory: ZeroShards, local: Dict[int, PieceState], to: Optional[int] = 0
) -> Optional[FullState]:
    """`local[k]`: the state of this rank's piece `shard_memory.pieces[k]` (missing: none yet). Collective
    over `shard_memory.group`; returns the full state on rank `to` (every rank when `to` is None)."""
    kinds = _agree_keys(shard_memory, local)
    xp, layout, pieces = shard_memory.device.xp, shard_memory.layout, shard_memory.pieces
    mine = to is None or shard_memory.rank == to
    full: FullState = {}
    scalar_keys = sorted(k for k, kind in kinds.items() if kind == "s")
    # per parameter: [present, scalars...] from the rank owning its first element
    table = np.zeros((layout.num_params, 1 + len(scalar_keys)), np.float64)
    for k, piece in enumerate(pieces):
        if piece.param_lo == 0 and k in local:
            table[piece.param, 0] = 1
            for j, key in enumerate(scalar_keys):
                table[piece.param, 1 + j] = float(local[k][key])
    buf = xp.asarray(table.reshape(-1))
    shard_memory.blocking(
        lambda s: shard_memory.group.all_reduce(
            buf, ReduceOp.SUM, stream=s, tag="per-parameter optimizer scalars"
        )
    )
    summed = np.asarray(to_host(buf), np.float64).reshape(table.shape)
    present = [p for p in range(layout.num_params) if summed[p, 0] > 0]
    if mine:
        for p in present:
            full[p] = {key: float(summed[p, 1 + j]) for j, key in enumerate(scalar_keys)}
    for key in sorted(k for k, kind in kinds.items() if kind == "e"):
        for b, bucket in enumerate(layout.buckets):
            shard = shard_memory.device.zeros(shard_memory.shards.shard_numel[b], np.float32)
            for k, piece in enumerate(pieces):
                if piece.bucket == b and k in local:
                    shard[piece.shard_lo : piece.shard_lo + piece.numel] = local[k][key]
            whole = shard_memory.device.zeros(bucket.padded, np.float32)
            shard_memory.blocking(
                functools.partial(
                    _all_gather, shard_memory, whole, shard, f"optimizer state {key!r} of bucket {b}"
                )
            )
            if mine:
                for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
                    if p in full:
                        full[p][key] = whole[off : off + n].copy()
    return full if mine else None


def reshard(
    shards: ShardLayout, rank: int, full: FullState, numels: List[int], names: List[str]
) -> Dict[int, PieceState]:
    """This rank's piece states (keyed by index into `shards.pieces(rank)`) cut from `full`;
    `ConfigError` naming the parameter when a state array does not fit it (nothing is cut)."""
    for p, state in full.items():
        if not 0 <= p < len(numels):
            raise ConfigError(
                f"optimizer state for parameter index {p}, but the optimizer has "
                f"{len(numels)} parameters: the checkpoint is from another model"
            )
        for key, v in state.items():
            if not np.isscalar(v) and int(np.size(v)) != numels[p]:
                raise ConfigError(
                    f"optimizer state {key!r} of parameter {names[p]} has {int(np.size(v))} "
                    f"elements, the parameter {numels[p]}: the checkpoint is from another model "
                    "(or another parameter order)"
                )
    out: Dict[int, PieceState] = {}
    for k, piece in enumerate(shards.pieces(rank)):
        entry = full.get(piece.param)
        if entry is not None:
            out[k] = {
                key: (v if np.isscalar(v) else v.reshape(-1)[piece.param_lo : piece.param_hi])
                for key, v in entry.items()
            }
    return out


def _agree_keys(shard_memory: ZeroShards, local: Dict[int, PieceState]) -> Dict[str, str]:
    """Every rank's state keys with their kind ("e" elementwise, "s" scalar), the same on all."""
    kinds: Dict[str, str] = {}
    for state in local.values():
        for key, v in state.items():
            kind = "s" if np.isscalar(v) else "e"
            if kinds.setdefault(key, kind) != kind:
                raise ConfigError(
                    f"rank {shard_memory.rank}: optimizer state {key!r} is a scalar for some "
                    "parameters and an array for others; cannot shard it"
                )
    raw = json.dumps(sorted(kinds.items())).encode()
    if len(raw) > _KEYS_BYTES:
        raise ConfigError(
            f"rank {shard_memory.rank}: optimizer state keys {sorted(kinds)} are too many "
            f"to exchange ({len(raw)} > {_KEYS_BYTES} bytes)"
        )
    mine = np.zeros(_KEYS_BYTES, np.uint8)
    mine[: len(raw)] = np.frombuffer(raw, np.uint8)
    xp = shard_memory.device.xp
    inp = xp.asarray(mine)
    out = xp.zeros(_KEYS_BYTES * shard_memory.group.size, np.uint8)
    shard_memory.blocking(functools.partial(_all_gather, shard_memory, out, inp, "optimizer state key names"))
    allk: Dict[str, str] = {}
    for r, row in enumerate(np.asarray(to_host(out)).reshape(shard_memory.group.size, _KEYS_BYTES)):
        for key, kind in json.loads(bytes(row).rstrip(b"\0").decode() or "[]"):
            if allk.setdefault(key, kind) != kind:
                raise ConfigError(f"optimizer state {key!r} is a scalar on one rank and an array on rank {r}")
    return allk


def _all_gather(shard_memory: ZeroShards, out: Any, inp: Any, tag: str, stream: Stream) -> Any:
    return shard_memory.group.all_gather(out, inp, stream=stream, tag=tag)
