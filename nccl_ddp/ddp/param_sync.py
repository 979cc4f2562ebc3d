"""DDP's init_sync: check that every rank wraps the same parameters with the same settings, then
copy rank 0's values.

The check is one all_gather of a 32-byte digest; only on a mismatch are the descriptions
exchanged, so that every rank raises the same `RankMismatchError` naming the first difference.
The broadcast packs the bytes of parameters and buffers (any dtypes) into chunks, one broadcast
per chunk.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp.buckets.layout import ParamSpec
from nccl_ddp.buckets.memory import to_host
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.device.base import Device
from nccl_ddp.errors import RankMismatchError


@dataclass(frozen=True)
class Subject:
    """What a list of specs describes, for the mismatch message: e.g. 'wrapped parameters', one
    'parameter', and what every rank must do."""

    items: str
    noun: str
    advice: str


WRAPPED = Subject(
    "wrapped parameters", "parameter", "wrap the same model (same parameters in the same order)"
)
BROADCAST = Subject("variables broadcast", "variable", "pass the same variables in the same order")


def check_same_params(
    specs: Sequence[ParamSpec],
    group: ProcessGroup,
    device: Device,
    settings: Optional[dict] = None,
    *,
    owner: str = "DistributedDataParallel",
    subject: Subject = WRAPPED,
) -> None:
    """`RankMismatchError` on every rank unless all ranks have the same shapes and dtypes (and
    names, where given) in the same order and the same `settings` (name -> JSON value: the options
    of `owner` that every rank must share). `subject`: what the specs describe, for the message."""
    settings = json.loads(json.dumps(settings or {}))  # tuples -> lists, as the peers' arrive
    # names, where the framework gives them: same-shape parameters in a different order would
    # otherwise pass and be averaged with the wrong tensors
    text = ";".join(f"{s.name or ''}:{tuple(s.shape)}:{s.dtype}" for s in specs)
    digest = hashlib.sha256(f"{len(specs)}|{text}|{json.dumps(settings, sort_keys=True)}".encode()).digest()
    digests = _all_gather_bytes(digest, group, device)
    if all(d == digests[0] for d in digests):
        return
    mine = json.dumps(
        {"params": [[list(s.shape), str(s.dtype), s.name] for s in specs], "settings": settings}
    ).encode()
    lengths = _all_gather_bytes(np.int64(len(mine)).tobytes(), group, device)
    longest = max(int(np.frombuffer(n, dtype=np.int64)[0]) for n in lengths)
    blobs = _all_gather_bytes(mine.ljust(longest, b" "), group, device)
    described = [json.loads(b.decode()) for b in blobs]
    raise RankMismatchError(f"rank {group.rank}: {_first_mismatch(described, owner, subject)}")


def _first_mismatch(described: list, owner: str, subject: Subject) -> str:
    base = described[0]["params"]
    for r, other in enumerate((d["params"] for d in described[1:]), start=1):
        for i in range(max(len(base), len(other))):
            a = base[i] if i < len(base) else None
            b = other[i] if i < len(other) else None
            if a is not None and b is not None and a == b:
                continue
            names = a is not None and b is not None and a[2] != b[2]
            name = (a or b or (None, None, None))[2]
            noun = subject.noun
            label = f"{noun} {i}" + (f" ({name!r})" if name and not names else "")
            return (
                f"the {subject.items} differ across ranks: {label}: "
                f"rank 0 has {_describe(a, len(base), names, noun)}, "
                f"rank {r} has {_describe(b, len(other), names, noun)}. Every rank must {subject.advice}."
            )
    base = described[0]["settings"]
    for r, other in enumerate((d["settings"] for d in described[1:]), start=1):
        for key in sorted(set(base) | set(other)):
            a, b = base.get(key), other.get(key)
            if a == b:
                continue
            what = key
            if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):  # per parameter
                i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                what, a, b = f"{key} of parameter {i}", a[i], b[i]
            return (
                f"ranks created {owner} with different settings: {what}: rank 0 has {a!r}, "
                f"rank {r} has {b!r}. Every rank must pass the same {key}."
            )
    return "the wrapped parameters or settings differ across ranks (digest mismatch)"


def _describe(entry: Optional[list], count: int, named: bool = False, noun: str = "parameter") -> str:
    if entry is None:
        return f"no such {noun} (only {count})"
    return (f"{entry[2]!r} of " if named else "") + f"shape {tuple(entry[0])} {entry[1]}"


def _all_gather_bytes(data: bytes, group: ProcessGroup, device: Device) -> list:
    inp = device.xp.asarray(np.frombuffer(data, dtype=np.uint8))
    out = device.xp.empty(len(data) * group.size, dtype=np.uint8)
    group.all_gather(out, inp).wait(group.timeout)
    host = to_host(out)
    return [host[r * len(data) : (r + 1) * len(data)].tobytes() for r in range(group.size)]


def broadcast_coalesced(
    arrays: Sequence[Any], group: ProcessGroup, device: Device, chunk_bytes: int, src: int = 0
) -> None:
    """Overwrite every rank's `arrays` (any dtypes and strides, writable) with rank `src`'s: their
    bytes packed into one buffer per chunk of up to `chunk_bytes` (an array larger than that
    goes alone), so a model's parameters or buffers cost one broadcast per chunk."""
    compute = device.current_stream()
    for chunk in _byte_chunks([a for a in arrays if a.nbytes], chunk_bytes):
        buf = device.empty(_offsets(chunk)[-1], np.uint8)
        if group.rank == src:
            compute.submit(_pack_bytes, chunk, buf)
        compute.synchronize(group.timeout)
        group.broadcast(buf, src).wait(group.timeout)
        if group.rank != src:
            compute.submit(_unpack_bytes, chunk, buf)
    compute.synchronize(group.timeout)


def _byte_chunks(arrays: Sequence[Any], chunk_bytes: int) -> list:
    chunks: list = [[]]
    size = 0
    for a in arrays:
        if chunks[-1] and size + a.nbytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(a)
        size += a.nbytes
    return [c for c in chunks if c]


def _offsets(arrays: Sequence[Any], align: int = 16) -> list:
    """Where each array starts in the chunk (aligned, so typed views of the chunk are aligned),
    and the chunk's size last."""
    offsets = [0]
    for a in arrays:
        offsets.append(-(-(offsets[-1] + a.nbytes) // align) * align)
    return offsets


def _pack_bytes(arrays: Sequence[Any], buf: Any) -> None:
    for a, off in zip(arrays, _offsets(arrays)):
        buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)  # reshape copies if strided


def _unpack_bytes(arrays: Sequence[Any], buf: Any) -> None:
    for a, off in zip(arrays, _offsets(arrays)):
        a[...] = buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
