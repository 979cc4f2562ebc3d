"""`ShardedParams`: parameter sharding (ZeRO-3) for arrays of any framework (NumPy/CuPy, JAX
pytrees, Paddle tensors, any DLPack framework's list), functional, framework-free:

    sp = nd.ShardedParams(params, nd.ShardAdamW(lr=1e-3), units=[["w1", "b1"], ["w2", "b2"]])
    for x, y in batches:
        full = sp.gather()               # this step's parameters, whole, in the caller's framework
        grads = grad_fn(full, x, y)      # this rank's grads, whole, same structure
        sp.step(grads)                   # reduce-scatter (mean) + the optimizer on the shards

Each leaf is cut along dim 0 in `world` chunks (zero/params.py: torch.chunk's cut, padded); a
rank keeps only its chunks (one flat shard per unit and dtype), the optimizer state of those and,
for bfloat16/float16 leaves, their float32 masters. `gather_unit(u)` gathers one unit and starts
the next one's gather before it returns, so that gather runs on the comm stream while the caller
computes with unit u:

  caller: ─gather_unit(0): wait(0)─[compute 0]─gather_unit(1): wait(1)─[compute 1]──step──
               ╲ start(0), start(1)                 ╲ start(2)
  comm:   ─────[all-gather 0 | copy out][all-gather 1 | copy out][all-gather 2 ...]

`step` queues every unit's reduce-scatter on the comm stream, then steps each unit's shards as
soon as its reduction is done (the optimizer of unit u overlaps the reduction of u + 1). Every
collective is issued in the same order on every rank: all ranks call `gather`/`gather_unit`/
`step` alike.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.dlpack import is_bfloat16
from nccl_ddp.buckets.memory import to_host
from nccl_ddp.comm.api import device_of, resolve_group
from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp.interfaces import GradsAdapter, adapter_of
from nccl_ddp.ddp.native_tree import NativeTree
from nccl_ddp.ddp.param_sync import Subject, broadcast_coalesced, check_same_params
from nccl_ddp.device import Event
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.zero.params import ScratchPool, UnitShards, unit_layout

OWNER = "ShardedParams"
_SUBJECT = Subject(
    "parameters given to ShardedParams",
    "leaf",
    "pass the same parameters (same structure, shapes and dtypes)",
)
_INITS = ("broadcast", "check")
_BROADCAST_CHUNK = 64 << 20  # bytes per broadcast while the initial values are sent


class ShardOptimizer(Protocol):
    """What `ShardedParams` steps each flat float32 shard with: `nd.ShardSGD`, `nd.ShardAdamW`
    (or an adapter's, e.g. optax's over shards), as in docs/zero.md "Fused optimizers"."""

    def init_state(self, master: Any) -> Any: ...

    def step(
        self,
        master: Any,
        grad: Any,
        state: Any,
        params_out: Optional[Any] = None,
        *,
        grad_scale: float = 1.0,
        lr: Optional[float] = None,
    ) -> None: ...


Units = Optional[Sequence[Sequence[Union[int, str]]]]


@dataclasses.dataclass
class _Unit:
    """One unit: which leaves (flattened order), its shards, float32 masters and optimizer
    state per dtype bucket, and its gather in flight (event, unsharded outputs) if any."""

    leaves: List[int]
    shards: UnitShards
    masters: List[Any]
    low: List[bool]  # bucket b's parameters are not float32: the kernel writes the shard too
    states: List[Any]
    pending: Optional[Tuple[Event, List[Any]]] = None


class ShardedParams:
    """Parameters sharded along dim 0 across `group` in units (see the module doc). Collective:
    every rank builds it with the same parameters (structure, shapes, dtypes, names: compared
    first, `RankMismatchError` naming the rank and leaf on every rank), units and optimizer.

    `params`: a list/tuple/dict of NumPy/CuPy arrays, a JAX pytree, or a list/tuple of one
    framework's tensors (Paddle, ...); float32, bfloat16 or float16 leaves of at least one
    dimension. `optimizer`: a `ShardOptimizer` (`nd.ShardAdamW`, `nd.ShardSGD`). `units`: None
    (one unit of every leaf) or groups of leaves, by flattened index or name (a dict key, JAX's
    key path such as "['w1']", a Paddle parameter's name), each leaf in exactly one.
    `init`: "broadcast" (rank 0's values) or "check" (every rank's values must already be equal:
    a digest per leaf is compared, `RankMismatchError` otherwise)."""

    def __init__(
        self,
        params: Any,
        optimizer: ShardOptimizer,
        *,
        units: Units = None,
        group: Optional[ProcessGroup] = None,
        init: str = "broadcast",
    ) -> None:
        if not (
            callable(getattr(optimizer, "init_state", None)) and callable(getattr(optimizer, "step", None))
        ):
            raise ConfigTypeError(
                f"{OWNER}: optimizer must be a shard optimizer (nd.ShardAdamW, nd.ShardSGD: "
                f"init_state(master) and step(master, grad, state, ...)), got {type(optimizer).__name__}"
            )
        self.optimizer, self.group = optimizer, resolve_group(group, "group")
        self.device = device_of(self.group)
        self._tree, self._leaf_out = _structure(params)
        self.specs = self._tree.param_infos(params)
        natives = self._tree.to_native(params)
        settings: Dict[str, Any] = {
            "units": _units_as_given(units),
            "optimizer": _describe_optimizer(optimizer),
            "init": init if isinstance(init, str) else repr(init),
        }
        if init == "check":
            settings["value digest"] = [_digest(x) for x in natives]
        # one collective before anything else: every rank raises the same error, naming the leaf
        check_same_params(self.specs, self.group, self.device, settings, owner=OWNER, subject=_SUBJECT)
        # the same arguments on every rank now: each raises the same error, if any
        if init not in _INITS:
            raise ConfigError(f"{OWNER}: init must be one of {_INITS}, got {init!r}")
        self._unit_leaves = _resolve_units(units, self.specs)
        for i, s in enumerate(self.specs):
            _check_leaf(i, s.name, tuple(s.shape), np.dtype(s.dtype))
        # the skeleton: the parameters' structure over one-element leaves (the whole values
        # are not kept), which the framework's adapter rebuilds gathered trees from
        self._skeleton = self._tree.from_native(params, [self.device.zeros(1, s.dtype) for s in self.specs])
        self.comm = self.device.new_stream()
        self.scratch = ScratchPool(functools.partial(self.group.zeros, self.device))
        self.units = [
            self._build_unit(u, leaves, natives, init) for u, leaves in enumerate(self._unit_leaves)
        ]
        self.steps = 0

    # ------------------------------------------------------------------ construction

    def _build_unit(self, u: int, leaves: List[int], natives: List[Any], init: str) -> _Unit:
        specs = [self.specs[i] for i in leaves]
        layout = unit_layout(specs, self.group.size, self.device.align_bytes)
        shards = UnitShards(layout, self.group, self.device, self.comm, self.scratch, f"{OWNER} unit {u}")
        values = [natives[i] for i in leaves]
        if init == "broadcast":  # rank 0's values, one unit's copies alive at a time
            values = [self.device.xp.array(x) for x in values]
            broadcast_coalesced(values, self.group, self.device, _BROADCAST_CHUNK)
        rank = self.group.rank
        for j, x in enumerate(values):
            lo = rank * layout.rows[j] * layout.row_numel[j]
            local = shards.local(j)
            local[...] = x.reshape(-1)[lo : lo + local.size]
        masters, low = [], []
        for b, bucket in enumerate(layout.shard.buckets):
            is_low = np.dtype(bucket.dtype) != np.float32
            masters.append(shards.shards[b].astype(np.float32) if is_low else shards.shards[b])
            low.append(is_low)
        states = [self.optimizer.init_state(m) for m in masters]
        return _Unit(list(leaves), shards, masters, low, states)

    # ------------------------------------------------------------------ gather

    def gather(self) -> Any:
        """Every leaf, whole, in the parameters' structure and framework: new arrays each call
        (they never change afterwards). Collective."""
        for unit in self.units:
            self._start_gather(unit)
        outs: List[Any] = [None] * len(self.specs)
        for unit in self.units:
            for i, x in zip(unit.leaves, self._wait_gather(unit)):
                outs[i] = x
        return self._tree.from_native(self._skeleton, outs)

    def gather_unit(self, u: int, prefetch: bool = True) -> List[Any]:
        """Unit u's leaves, whole, in the framework's arrays, in the unit's order. With `prefetch`,
        the next unit's gather is started before this one is waited for. Collective."""
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < len(self.units):
            raise ConfigError(
                f"{OWNER}.gather_unit: unit must be an int in [0, {len(self.units)}), got {u!r}"
            )
        unit = self.units[u]
        self._start_gather(unit)
        if prefetch and u + 1 < len(self.units):
            self._start_gather(self.units[u + 1])
        return [self._leaf_out(x) for x in self._wait_gather(unit)]

    def _start_gather(self, unit: _Unit) -> None:
        if unit.pending is not None:
            return
        outs = [self.device.empty(s.numel, s.dtype) for s in unit.shards.layout.specs]
        unit.pending = (unit.shards.start_gather(outs), outs)

    def _wait_gather(self, unit: _Unit) -> List[Any]:
        assert unit.pending is not None  # _start_gather ran
        event, outs = unit.pending
        unit.pending = None
        event.synchronize(self.group.timeout)
        return [x.reshape(s.shape) for x, s in zip(outs, unit.shards.layout.specs)]

    # ------------------------------------------------------------------ step

    def step(self, grads: Any, *, lr: Optional[float] = None) -> None:
        """Average every rank's `grads` (whole, this rank's own, the parameters' structure and
        shapes) into this rank's shards (one reduce-scatter per unit and dtype, in float32) and
        step the optimizer on them; the next gather returns the updated values. `lr` overrides
        the optimizer's for this step. Collective."""
        try:
            natives = self._tree.to_native(grads)
        except (ConfigError, ConfigTypeError) as e:  # the adapter's own: say which rank and call
            raise type(e)(f"rank {self.group.rank}: {OWNER}.step: {e}") from e
        self._check_grads(natives)
        flat = [g.reshape(-1) for g in natives]
        for unit in self.units:  # a gather started before the step reads the old values: drop it
            if unit.pending is not None:
                unit.pending[0].synchronize(self.group.timeout)
                unit.pending = None
        started = [
            u.shards.start_reduce([flat[i] for i in u.leaves], np.float32, ReduceOp.AVG) for u in self.units
        ]
        for unit, (event, reduced) in zip(self.units, started):
            event.synchronize(self.group.timeout)
            assert reduced is not None  # no replicate group here: start_reduce returns the shards
            for b, (master, grad, state) in enumerate(zip(unit.masters, reduced, unit.states)):
                out = unit.shards.shards[b] if unit.low[b] else None
                self.optimizer.step(master, grad, state, params_out=out, lr=lr)
        self.steps += 1

    def _check_grads(self, natives: Sequence[Any]) -> None:
        """Local checks of the grads against the parameters, before anything is sent."""
        if len(natives) != len(self.specs):
            raise ConfigError(
                f"rank {self.group.rank}: {OWNER}.step: grads has {len(natives)} leaves, the "
                f"parameters {len(self.specs)}; pass grads of the parameters' structure"
            )
        for i, (g, s) in enumerate(zip(natives, self.specs)):
            dt = np.dtype(g.dtype)
            if tuple(g.shape) != tuple(s.shape) or not (dt.kind == "f" or is_bfloat16(dt)):
                raise ConfigError(
                    f"rank {self.group.rank}: {OWNER}.step: the grad of leaf {i} ({s.name!r}) has "
                    f"shape {tuple(g.shape)} {dt}, the parameter is {tuple(s.shape)} {np.dtype(s.dtype)}; "
                    "pass a floating grad of the parameter's shape"
                )

    # ------------------------------------------------------------------ memory

    @property
    def shard_nbytes(self) -> int:
        """Bytes of this rank's parameter shards (padding included)."""
        return sum(u.shards.nbytes for u in self.units)

    @property
    def state_nbytes(self) -> int:
        """Bytes of this rank's optimizer state and float32 masters of low-precision shards."""
        total = 0
        for unit in self.units:
            total += sum(m.nbytes for m, low in zip(unit.masters, unit.low) if low)
            for state in unit.states:
                total += sum(getattr(x, "nbytes", 0) for x in _state_arrays(state))
        return total

    def close(self) -> None:
        """Wait for the gathers in flight and stop the comm stream."""
        for unit in self.units:
            if unit.pending is not None:
                unit.pending[0].synchronize(self.group.timeout)
                unit.pending = None
        self.comm.close()


def _structure(params: Any) -> Tuple[GradsAdapter, Callable[[Any], Any]]:
    """The adapter of the parameters' structure and a converter of one native array into the
    framework's (the array itself for NumPy/CuPy)."""
    name = frameworks.framework_of_leaves(params)
    if name is None:
        return NativeTree(OWNER), lambda x: x
    adapter = adapter_of(name)
    return adapter.grads_adapter(), adapter.from_native


def _units_as_given(units: Units) -> Optional[List[List[Any]]]:
    """`units` as every rank can compare them (JSON: names, indices, reprs of anything else);
    ConfigTypeError for a container that is no list of lists."""
    if units is None:
        return None
    if isinstance(units, (str, bytes)) or not isinstance(units, (list, tuple)) or not units:
        raise ConfigTypeError(
            f"{OWNER}: units must be None or a non-empty list of lists of leaves, got {units!r}"
        )
    for u, group in enumerate(units):
        if isinstance(group, (str, bytes)) or not isinstance(group, (list, tuple)) or not group:
            raise ConfigTypeError(f"{OWNER}: units[{u}] must be a non-empty list of leaves, got {group!r}")
    plain = (str, int)
    return [[x if isinstance(x, plain) and not isinstance(x, bool) else repr(x) for x in g] for g in units]


def _resolve_units(units: Units, specs: Sequence[Any]) -> List[List[int]]:
    """`units` as lists of leaf indices, each leaf in exactly one (ConfigError naming it);
    `_units_as_given` has checked the containers."""
    if units is None:
        return [list(range(len(specs)))]
    names = {s.name: i for i, s in enumerate(specs) if s.name is not None}
    owner: Dict[int, int] = {}
    out = []
    for u, group in enumerate(units):
        leaves = []
        for leaf in group:
            if isinstance(leaf, str) and leaf in names:
                i = names[leaf]
            elif isinstance(leaf, int) and not isinstance(leaf, bool) and 0 <= leaf < len(specs):
                i = leaf
            else:
                raise ConfigError(
                    f"{OWNER}: units[{u}] names leaf {leaf!r}, which the parameters do not have "
                    f"(leaves: {len(specs)}, names: {sorted(names)[:20]})"
                )
            if i in owner:
                raise ConfigError(
                    f"{OWNER}: leaf {leaf!r} is in units[{owner[i]}] and units[{u}]: put it in one"
                )
            owner[i] = u
            leaves.append(i)
        out.append(leaves)
    missing = [specs[i].name or i for i in range(len(specs)) if i not in owner]
    if missing:
        raise ConfigError(f"{OWNER}: leaves {missing} are in no unit: every leaf must be in one")
    return out


def _check_leaf(i: int, name: Optional[str], shape: Tuple[int, ...], dtype: np.dtype) -> None:
    label = f"leaf {i}" + (f" ({name!r})" if name else "")
    if not shape:
        raise ConfigError(
            f"{OWNER}: {label} has no dimensions, so it cannot be sharded along dim 0: give it shape (1,)"
        )
    if dtype not in (np.dtype(np.float32), np.dtype(np.float16)) and not is_bfloat16(dtype):
        raise ConfigError(
            f"{OWNER}: {label} is {dtype}; the shard optimizers step float32, bfloat16 and float16 "
            "parameters: cast it, or keep it out of the sharded parameters"
        )


def _describe_optimizer(optimizer: Any) -> Any:
    config = getattr(optimizer, "config", None)
    fields = (
        dataclasses.asdict(config)
        if dataclasses.is_dataclass(config) and not isinstance(config, type)
        else {}
    )
    return {"type": type(optimizer).__name__, **fields}


def _digest(x: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(to_host(x)).tobytes()).hexdigest()[:16]


def _state_arrays(state: Any) -> List[Any]:
    """A shard optimizer state's arrays: its `buffers` (ShardState's, ShardOptax's)."""
    buffers = getattr(state, "buffers", None)
    return list(buffers.values()) if isinstance(buffers, dict) else []
