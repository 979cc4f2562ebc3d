"""The torch.distributed-like functional collectives on any DLPack array (converted by
`nccl_ddp.arrays.dlpack`), over the world group of `comm/api.py` or a `new_group`.

    nd.all_reduce(grad, op="avg")            # in place on NumPy / torch CPU / CuPy arrays
    w = nd.all_reduce(x, async_op=True); ...; x = w.result()
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from nccl_ddp.arrays import dlpack
from nccl_ddp.comm.api import check_timeout, require_world
from nccl_ddp.comm.group import NonMemberGroup, ProcessGroup, ReduceOp, Work
from nccl_ddp.device import HostDevice
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool

_DEVICE_KIND = {"host": "host", "nccl": "cuda"}
_IMMEDIATE = HostDevice().current_stream()


class ApiWork(Work):
    """A backend Work plus the step that turns its native output into the caller's object."""

    def __init__(self, inner: Work, finish: Callable[[], Any]) -> None:
        self._inner, self._finish = inner, finish
        self._done, self._value = False, None

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is not None:
            check_timeout(timeout, "Work.wait")
        self._inner.wait(timeout)
        if not self._done:
            self._value, self._done = self._finish(), True
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def result(self) -> Any:
        self.wait()
        return self._value


class _Buf:
    """One caller array as a contiguous native buffer; `finish()` writes back and returns what
    the caller gets."""

    def __init__(self, x: Any, kind: str, where: str) -> None:
        self.x = x
        self.native = dlpack.to_native(x, kind, where)
        contiguous = self.native.flags.c_contiguous
        self.buf = self.native if contiguous else self.native.copy()  # copy() is C order

    def finish(self) -> Any:
        if self.buf is not self.native:
            self.native[...] = self.buf
        return dlpack.from_native(self.native, self.x)


def _context(group: Optional[ProcessGroup], what: str, async_op: bool) -> tuple:
    """(group, device kind, error prefix, stream to pass) for one API call."""
    w = require_world(what)
    check_bool("async_op", async_op)
    g = w.group if group is None else group
    if isinstance(g, NonMemberGroup):
        raise g.refuse(what)
    if not isinstance(g, ProcessGroup):
        raise ConfigError(
            f"rank {w.env.rank}: {what}: group must be a ProcessGroup from "
            f"new_group() (or None for the world), got {type(g).__name__}"
        )
    # synchronous host calls pass the caller's immediate stream: the op may then run on the
    # calling thread, saving two thread switches
    stream = _IMMEDIATE if g.backend == "host" and not async_op else None
    return g, _DEVICE_KIND[g.backend], f"rank {w.env.rank}: {what} on group {g.name!r}", stream


def _run(work: Work, finish: Callable[[], Any], async_op: bool) -> Any:
    w = ApiWork(work, finish)
    if async_op:
        return w
    return w.result()


def all_reduce(
    x: Any, op: ReduceOp | str = "sum", group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Any:
    """Reduce `x` over the group (in place where possible); returns `x` or the new array.

    op: sum, avg, max, min, prod. avg on integer dtypes sums in the dtype (wrapping like NCCL)
    and truncates toward zero; bool supports max (any) and min (all) only."""
    g, kind, where, stream = _context(group, "all_reduce", async_op)
    with g.checking("all_reduce"):  # refused here only: the group is poisoned
        b = _Buf(x, kind, where)
        return _run(g.all_reduce(b.buf, ReduceOp.parse(op), stream), b.finish, async_op)


def broadcast(x: Any, src: int = 0, group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Copy global rank `src`'s `x` to every member of the group."""
    g, kind, where, stream = _context(group, "broadcast", async_op)
    with g.checking("broadcast"):  # refused here only: the group is poisoned
        if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
            raise ConfigTypeError(
                f"{where}: src must be an int (a global rank), got {type(src).__name__} {src!r}"
            )
        if src not in g.ranks:
            raise ConfigError(
                f"{where}: src rank {src} is not a member of the group {list(g.ranks)}; src is a global rank"
            )
        b = _Buf(x, kind, where)
        return _run(g.broadcast(b.buf, g.ranks.index(src), stream), b.finish, async_op)


def _gather_parts(parts: Sequence[Any], g: ProcessGroup, kind: str, where: str, size: int, role: str) -> list:
    if len(parts) != g.size:
        raise ConfigError(
            f"{where}: {role} has {len(parts)} arrays but the group has {g.size} ranks; pass one per rank"
        )
    bufs = [_Buf(p, kind, where) for p in parts]
    for i, b in enumerate(bufs):
        if b.buf.size != size:
            raise ConfigError(f"{where}: {role}[{i}] has {b.buf.size} elements, expected {size}")
    return bufs


def all_gather(out: Any, x: Any, group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """`out` (a list of group-size arrays, or one array of group size x `x.size` elements)
    receives every member's `x`, in group-rank order. Returns `out` (or new arrays)."""
    g, kind, where, stream = _context(group, "all_gather", async_op)
    with g.checking("all_gather"):  # refused here only: the group is poisoned
        xi = _Buf(x, kind, where)
        if isinstance(out, (list, tuple)):
            parts = _gather_parts(out, g, kind, where, xi.buf.size, "out")
            flat = _empty_like(xi.buf, g.size * xi.buf.size)

            def finish() -> Any:
                res = []
                for i, p in enumerate(parts):
                    p.buf.reshape(-1)[...] = flat[i * xi.buf.size : (i + 1) * xi.buf.size]
                    res.append(p.finish())
                return type(out)(res) if isinstance(out, tuple) else _same_list(out, res)

            return _run(g.all_gather(flat, xi.buf.reshape(-1), stream), finish, async_op)
        o = _Buf(out, kind, where)
        return _run(g.all_gather(o.buf.reshape(-1), xi.buf.reshape(-1), stream), o.finish, async_op)


def reduce_scatter(
    out: Any,
    inputs: Any,
    op: ReduceOp | str = "sum",
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Any:
    """`inputs` (a list of group-size arrays, or one array of group size x `out.size`) is reduced
    over the group; member i receives part i in `out`. Returns `out` (or a new array)."""
    g, kind, where, stream = _context(group, "reduce_scatter", async_op)
    with g.checking("reduce_scatter"):  # refused here only: the group is poisoned
        o = _Buf(out, kind, where)
        if isinstance(inputs, (list, tuple)):
            parts = _gather_parts(inputs, g, kind, where, o.buf.size, "inputs")
            flat = _empty_like(o.buf, g.size * o.buf.size)
            for i, p in enumerate(parts):
                flat[i * o.buf.size : (i + 1) * o.buf.size] = p.buf.reshape(-1)
        else:
            flat = _Buf(inputs, kind, where).buf.reshape(-1)
        work = g.reduce_scatter(o.buf.reshape(-1), flat, ReduceOp.parse(op), stream)
        return _run(work, o.finish, async_op)


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Returns once every member of the group reached the barrier (a Work with async_op)."""
    g, _, _, stream = _context(group, "barrier", async_op)
    return _run(g.barrier(stream), lambda: None, async_op)


def _empty_like(a: Any, n: int) -> Any:
    if isinstance(a, np.ndarray):
        return np.empty(n, a.dtype)
    import cupy

    return cupy.empty(n, a.dtype)


def _same_list(out: list, res: list) -> list:
    """The caller's list, updated where a framework array could not be written in place."""
    for i, r in enumerate(res):
        if r is not out[i]:
            out[i] = r
    return out
