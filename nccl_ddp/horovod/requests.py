"""The requests Horovod's matching exchanges (negotiation.py): what one rank says about an op,
its wire encoding (int64 words), and Horovod's checks of the members' requests for one op
(horovod/common/controller.cc's messages)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

import nccl_ddp as nd
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import NcclDdpError, RankMismatchError
from nccl_ddp.horovod.arrays import NativeArray

# Horovod's request types (message.h) and the ones the facade adds; the index is the wire code
KINDS = (
    "ALLREDUCE",
    "ALLGATHER",
    "BROADCAST",
    "JOIN",
    "ALLTOALL",
    "BARRIER",
    "REDUCESCATTER",
    "GROUPED_ALLREDUCE",
    "GROUPED_BROADCAST",
    "ALLGATHER_OBJECT",
    "BROADCAST_OBJECT",
)
# kinds whose shapes must agree exactly; allgather-like ones agree on the dims after the first
_EXACT = {"ALLREDUCE", "BROADCAST", "REDUCESCATTER", "GROUPED_ALLREDUCE", "GROUPED_BROADCAST"}
_ALLGATHER_LIKE = {"ALLGATHER", "ALLTOALL"}
_SCALED = {"ALLREDUCE", "REDUCESCATTER", "GROUPED_ALLREDUCE"}
_ROOTED = {"BROADCAST", "GROUPED_BROADCAST", "BROADCAST_OBJECT"}
JOINABLE = {"ALLREDUCE", "GROUPED_ALLREDUCE", "BARRIER", "JOIN"}  # what a joined rank takes part in

DTYPE_NAMES = (
    "",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bool",
    "bfloat16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
)


def dtype_code(dtype: object) -> int:
    name = str(getattr(dtype, "name", dtype))
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else 100 + _key(name) % 1000


def dtype_name(code: int) -> str:
    return DTYPE_NAMES[code] if 0 < code < len(DTYPE_NAMES) else f"dtype#{code}"


def _key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _bits(x: float) -> int:
    return int(np.array(x, np.float64).view(np.int64))


def _float(bits: int) -> float:
    return float(np.array(bits, np.int64).view(np.float64))


@dataclass(frozen=True)
class Request:
    """One rank's description of an op: what every member must agree on before data moves."""

    kind: str
    name: str
    dtype: int = 0  # dtype_code
    shape: Tuple[int, ...] = ()
    root: int = -1
    op: int = -1
    pre: float = 1.0
    post: float = 1.0
    extra: Tuple[int, ...] = ()  # alltoall's splits, grouped ops' (ndim, *shape, dtype) per tensor

    @property
    def key(self) -> int:
        return _key(self.name)

    def encode(self) -> List[int]:
        head = [KINDS.index(self.kind), self.key, self.dtype, self.root, self.op]
        return [
            *head,
            _bits(self.pre),
            _bits(self.post),
            len(self.shape),
            *self.shape,
            len(self.extra),
            *self.extra,
        ]


def decode(words: NativeArray, at: int, names: Dict[int, str]) -> Tuple[Request, int]:
    kind, key, dtype, root, op, pre, post, ndim = (int(w) for w in words[at : at + 8])
    at += 8
    shape = tuple(int(d) for d in words[at : at + ndim])
    at += ndim
    nextra = int(words[at])
    extra = tuple(int(d) for d in words[at + 1 : at + 1 + nextra])
    name = names.get(key, f"#{key:x}")
    req = Request(KINDS[kind], name, dtype, shape, root, op, _float(pre), _float(post), extra)
    return req, at + 1 + nextra


Records = List[Optional[Request]]  # each member's request for one op (None: a joined rank's)


_GROUPED = {"GROUPED_ALLREDUCE", "GROUPED_BROADCAST"}


def grouped_shapes(req: Request) -> List[Tuple[Tuple[int, ...], int]]:
    """(shape, dtype code) of each tensor of a grouped request (its `extra`)."""
    out, at, extra = [], 0, req.extra
    while at < len(extra):
        ndim = extra[at]
        out.append((tuple(extra[at + 1 : at + 1 + ndim]), extra[at + 1 + ndim]))
        at += ndim + 2
    return out


def _shape(r: Request) -> str:
    if r.kind in _GROUPED:
        return str([list(shape) for shape, _ in grouped_shapes(r)])
    return str(list(r.shape))


def mismatch(records: Records, group: ProcessGroup, where: str) -> Optional[NcclDdpError]:
    """Horovod's checks of one op's requests across the members (controller.cc's messages), with
    each rank's view; None when they agree."""
    present = [(i, r) for i, r in enumerate(records) if r is not None]
    _, first = present[0]
    problem = None
    for _, r in present[1:]:
        problem = _compare(first, r)
        if problem:
            break
    if problem is None:
        return None
    by_rank = {
        group.ranks[i]: f"{r.kind.lower()} {r.name!r} {dtype_name(r.dtype)}{_shape(r)}" for i, r in present
    }
    return RankMismatchError(
        f"rank {nd.get_rank()}: {where}: {problem} Requests by rank: {by_rank}; every rank must "
        "pass the same op, dtype and shape (allgather/alltoall: the same dims after the first) for "
        "the same name"
    )


def _what(r: Request) -> str:
    return "tensors of shapes" if r.kind in _GROUPED else "a tensor of shape"


def _compare(a: Request, b: Request) -> Optional[str]:
    if a.kind != b.kind:
        return f"Mismatched operations: One rank did an {a.kind}, but another rank did an {b.kind}."
    if a.dtype != b.dtype:
        return (
            f"Mismatched data types: One rank had type {dtype_name(a.dtype)}, but another rank had "
            f"type {dtype_name(b.dtype)}."
        )
    if a.kind in _EXACT and (a.shape != b.shape or a.extra != b.extra):
        return (
            f"Mismatched {a.kind.lower()} tensor shapes: One rank sent {_what(a)} {_shape(a)}, "
            f"but another rank sent {_what(b)} {_shape(b)}."
        )
    if a.kind in _ALLGATHER_LIKE:
        if len(a.shape) != len(b.shape):
            return (
                f"Mismatched {a.kind.lower()} tensor shapes: One rank sent a tensor of rank "
                f"{len(a.shape)}, but another rank sent a tensor of rank {len(b.shape)}."
            )
        for d in range(1, len(a.shape)):
            if a.shape[d] != b.shape[d]:
                return (
                    f"Mismatched {a.kind.lower()} tensor shapes: One rank sent a tensor with "
                    f"dimension {d} equal to {a.shape[d]}, but another rank sent a tensor with "
                    f"dimension {d} equal to {b.shape[d]}."
                )
    if a.kind in _SCALED and (a.pre, a.post) != (b.pre, b.post):
        return (
            f"Mismatched prescale and/or postscale factors: One rank sent factors ({a.pre}, "
            f"{a.post}), but another rank sent factors ({b.pre}, {b.post})."
        )
    if a.kind in _SCALED and a.op != b.op:
        return (
            f"Mismatched reduction operation: One rank sent reduction op {a.op}, but another rank "
            f"sent reduction op {b.op}."
        )
    if a.kind in _ROOTED and a.root != b.root:
        return (
            f"Mismatched {a.kind.lower()} root ranks: One rank specified root rank {a.root}, but "
            f"another rank specified root rank {b.root}."
        )
    return None
