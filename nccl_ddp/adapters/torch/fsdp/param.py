"""One sharded parameter of `fully_shard`: its shard along dim `dim` (0 unless
`shard_placement_fn` chose another) as a torch DTensor (`Shard(dim)` on the unit's DeviceMesh,
`(Replicate(), Shard(dim))` on HSDP's 2-D one; the local tensor, torch.chunk's chunk on `dim`,
a contiguous view of the unit's flat shard, so torch's optimizers, `clip_grad_norm_` and
`torch.distributed.checkpoint` work on it unchanged), and the unsharded `nn.Parameter` the
module computes with, whose storage is allocated for the all-gather and freed again at reshard
(FSDP2's scheme: autograd's saved references see the new values)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from nccl_ddp import kernels as K
from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.errors import ConfigError
from nccl_ddp.zero.params import UnitShards

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

Slot = Tuple["torch.nn.Module", str]  # where the parameter is registered: (module, attribute)


class ShardedParam:
    """Parameter `index` of a unit: `slots` are every (module, name) that registers it (tied
    weights within one unit); `shard_local` is this rank's rows in `orig_dtype` (the DTensor's
    local tensor), `unsharded` the full parameter in `compute_dtype`."""

    def __init__(
        self,
        index: int,
        fqn: str,
        slots: List[Slot],
        param: torch.nn.Parameter,
        shards: UnitShards,
        mesh: DeviceMesh,
        compute_dtype: torch.dtype,
        dim: int = 0,
    ) -> None:
        import torch

        self.index, self.fqn, self.slots, self.mesh, self.dim = index, fqn, slots, mesh, dim
        self.shape = tuple(param.shape)
        self.orig_dtype, self.compute_dtype = param.dtype, compute_dtype
        self.requires_grad = param.requires_grad
        self.rank = rank = shards.rank
        layout = shards.layout
        rows = layout.local_rows(index, rank)
        lo = min(rank * layout.rows[index], self.shape[dim])  # past the end: no rows
        self.local_shape = self.shape[:dim] + (rows,) + self.shape[dim + 1 :]
        chunk = from_native(shards.local(index)).view(self.local_shape)
        self._chunk = chunk  # this rank's rows in the shard memory (the gather's input)
        self.mirror: Optional[Any] = None if compute_dtype == param.dtype else chunk
        # the DTensor's local tensor in our memory; None for a meta parameter (FSDP2's deferred
        # init: a meta DTensor until `materialise`)
        self._ours: Optional[torch.Tensor] = None
        with torch.no_grad():
            if param.is_meta:
                local = torch.empty(chunk.shape, dtype=param.dtype, device="meta")
            else:
                local = self._ours = self._new_local()
                local.copy_(param.detach().narrow(dim, lo, rows))
            dt = _sharded(local, mesh, self.shape, dim)
        self.sharded = torch.nn.Parameter(dt, requires_grad=self.requires_grad)
        self.attrs: Dict[str, Any] = {}  # kept on `sharded` across tensor swaps (which swap __dict__)
        self.unsharded = torch.nn.Parameter(
            torch.empty(self.shape, dtype=compute_dtype, device=chunk.device),  # the shards' device
            requires_grad=self.requires_grad,
        )
        self._nbytes = self.unsharded.numel() * self.unsharded.element_size()
        self.free()
        self.grad_partial: Optional[torch.Tensor] = None  # local grads kept while not syncing
        self._grad_spec: Any = None  # the sharded grads' DTensorSpec, from the first one

    def _new_local(self) -> torch.Tensor:
        """The DTensor's local tensor: the shard itself, or (mixed precision) an fp32 tensor of
        our own (zeros) that is cast into the gather shard before each all-gather."""
        import torch

        return self._chunk if self.mirror is None else torch.zeros_like(self._chunk, dtype=self.orig_dtype)

    def tag(self, name: str, value: Any) -> None:
        """Set attribute `name` on the sharded Parameter, and again after any tensor swap."""
        self.attrs[name] = value
        setattr(self.sharded, name, value)

    def materialise(self) -> None:
        """After an `_apply` (`to_empty(device="cpu")`, `.to(...)`): the DTensor registered now
        gets its local tensor back in our shard memory (the values it holds copied in: none
        worth keeping after to_empty, which init then overwrites in place). Still meta: no-op."""
        import torch

        module, name = self.slots[0]
        new = module._parameters[name]
        if new is not self.sharded:  # _apply made a new Parameter (no tensor swap)
            self.sharded = new
            self.register(unsharded=False)
        with torch.no_grad():
            local = new.to_local()
            if not local.is_meta and (self._ours is None or local.data_ptr() != self._ours.data_ptr()):
                self._adopt(new, local)  # else still meta, or still our memory (.to() where it is)
        for k, v in self.attrs.items():
            setattr(new, k, v)

    def _adopt(self, new: Any, local: torch.Tensor) -> None:
        """`local`'s values into our memory, and `new` swapped to a DTensor over that memory."""
        import torch

        self._check_moved(local)
        ours = self._new_local()
        ours.copy_(local)
        torch.utils.swap_tensors(
            new, torch.nn.Parameter(_sharded(ours, self.mesh, self.shape, self.dim), new.requires_grad)
        )
        self._ours = ours

    def adopt_local(self, local: torch.Tensor) -> None:
        """This rank's rows `local` (a recast's values) copied into our shard memory, and the
        sharded parameter a DTensor over it."""
        import torch

        ours = self._new_local()
        ours.copy_(local)
        self._ours = ours
        self.sharded = torch.nn.Parameter(_sharded(ours, self.mesh, self.shape, self.dim), self.requires_grad)

    def check_apply(self, fn: Any) -> None:
        """Before an `_apply(fn)` moves anything: `fn` (tried on the sharded parameter) must keep
        it on its device (a new dtype is a recast: recast.py)."""
        import torch

        with torch.no_grad():
            self._check_moved(fn(self.sharded), any_dtype=True)

    def _check_moved(self, t: torch.Tensor, any_dtype: bool = False) -> None:
        where = self._chunk.device
        dtype_ok = any_dtype or t.dtype == self.orig_dtype
        if not dtype_ok or t.device.type not in (where.type, "meta"):
            raise ConfigError(
                f"rank {self.rank}: parameter {self.fqn!r} would become {t.dtype} on {t.device} "
                f"(it is {self.orig_dtype} on {where.type}, as fully_shard laid out its shards): "
                "change the dtype or device before fully_shard (or use a MixedPrecisionPolicy); "
                f"to_empty(device={where.type!r}) and .to({where.type!r}) are what works after it"
            )

    @property
    def meta(self) -> bool:
        """Still on the meta device (never materialised): it cannot be gathered."""
        return self._ours is None

    # ------------------------------------------------------------------ registration

    def register(self, unsharded: bool) -> None:
        """Make the modules' attribute the unsharded (compute) or the sharded (DTensor) one."""
        p = self.unsharded if unsharded else self.sharded
        for module, name in self.slots:
            module._parameters[name] = p

    # ------------------------------------------------------------------ unsharded memory

    def alloc(self) -> Any:
        """Storage for the unsharded values; returns its flat native view to gather into."""
        storage = self.unsharded.untyped_storage()
        if storage.size() != self._nbytes:
            storage.resize_(self._nbytes)
        return to_native(self.unsharded.detach().view(-1))

    def free(self) -> None:
        self.unsharded.untyped_storage().resize_(0)

    @property
    def allocated(self) -> bool:
        return self.unsharded.untyped_storage().size() > 0

    def cast_into_mirror(self) -> None:
        """Mixed precision: the fp32 shard, rounded into the gather shard (on the comm stream:
        on CUDA by our pack kernel on CuPy's current stream, which torch's copy_ would not use)."""
        import torch

        if self.mirror is None:
            return
        if self.mirror.is_cuda:
            src, dst = to_native(self.sharded.to_local().reshape(-1)), to_native(self.mirror.reshape(-1))
            if (K.dtype_name(src), K.dtype_name(dst)) in K.PACK_PAIRS:
                K.pack([src], dst, [0])
            else:  # a cast the kernel does not take (float64 -> float32): CuPy's, same stream
                dst[...] = src.astype(dst.dtype)
            return
        with torch.no_grad():
            self.mirror.copy_(self.sharded.to_local())

    # ------------------------------------------------------------------ grads

    def take_grad(self) -> Optional[torch.Tensor]:
        """The unsharded grad backward accumulated (plus the kept unsynchronised one), flat,
        contiguous, and no longer on the parameter."""
        g = self.unsharded.grad
        self.unsharded.grad = None
        if self.grad_partial is not None:
            g = self.grad_partial if g is None else g + self.grad_partial
            self.grad_partial = None
        return None if g is None else g.detach().contiguous().view(-1)

    def keep_grad(self) -> None:
        """Without gradient sync: move the unsharded grad aside, summed over the micro-batches."""
        g = self.unsharded.grad
        if g is not None:
            self.unsharded.grad = None
            self.grad_partial = g.detach() if self.grad_partial is None else self.grad_partial + g.detach()

    def add_sharded_grad(self, reduced: torch.Tensor, mesh: DeviceMesh) -> None:
        """This rank's reduced rows (a view of the reduce-scatter's output) as the sharded
        parameter's grad, or added to it (torch's accumulation until `zero_grad`)."""
        import torch

        local = reduced.view(self.local_shape)
        if local.dtype != self.orig_dtype:
            local = local.to(self.orig_dtype)
        with torch.no_grad():
            if self.sharded.grad is not None:
                self.sharded.grad.to_local().add_(local)
            elif self._grad_spec is None:  # the first: from_local builds (and checks) the spec
                self.sharded.grad = _sharded(local, mesh, self.shape, self.dim)
                self._grad_spec = self.sharded.grad._spec
            else:  # then the same spec again: a DTensor per grad and step without from_local's
                # Python work (a fifth of the end of backward's), as FSDP2's _from_local_no_grad
                from torch.distributed.tensor import DTensor

                self.sharded.grad = DTensor(local, self._grad_spec, requires_grad=False)


def _sharded(local: torch.Tensor, mesh: DeviceMesh, shape: tuple, dim: int) -> Any:
    """`local` as this rank's chunk along `dim` of a DTensor of `shape`: Shard(dim) on the
    mesh's last dim, replicated on the one before (HSDP's 2-D mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(dim)]
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape)
    )


def _contiguous(shape: tuple) -> tuple:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(1, d)
    return tuple(reversed(stride))
