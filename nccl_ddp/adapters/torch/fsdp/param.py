"""One sharded parameter of `fully_shard`: its dim-0 shard as a torch DTensor (`Shard(0)` on the
unit's DeviceMesh, `(Replicate(), Shard(0))` on HSDP's 2-D one; the local tensor a view of the
unit's flat shard, so torch's optimizers, `clip_grad_norm_` and `torch.distributed.checkpoint`
work on it unchanged), and the unsharded `nn.Parameter` the module computes with, whose storage
is allocated for the all-gather and freed again at reshard (FSDP2's scheme: autograd's saved
references see the new values)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from nccl_ddp.adapters.torch.tensors import from_native, to_native
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
    ) -> None:
        import torch

        self.index, self.fqn, self.slots = index, fqn, slots
        self.shape = tuple(param.shape)
        self.orig_dtype, self.compute_dtype = param.dtype, compute_dtype
        self.requires_grad = param.requires_grad
        rank, layout = shards.rank, shards.layout
        rows = layout.local_rows(index, rank)
        lo = rank * layout.rows[index]
        chunk = from_native(shards.local(index)).view(rows, *self.shape[1:])
        with torch.no_grad():
            if compute_dtype == param.dtype:
                local = chunk  # the DTensor's local tensor is the shard itself
            else:  # mixed precision: fp32 shard of our own, cast into the gather shard
                local = torch.empty_like(chunk, dtype=param.dtype)
            local.copy_(param.detach()[lo : lo + rows])
            self.mirror: Optional[Any] = None if local is chunk else chunk
            dt = _sharded(local, mesh, self.shape)
        self.sharded = torch.nn.Parameter(dt, requires_grad=self.requires_grad)
        self.unsharded = torch.nn.Parameter(
            torch.empty(self.shape, dtype=compute_dtype, device=param.device),
            requires_grad=self.requires_grad,
        )
        self._nbytes = self.unsharded.numel() * self.unsharded.element_size()
        self.free()
        self.grad_partial: Optional[torch.Tensor] = None  # local grads kept while not syncing

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
        """Mixed precision: the fp32 shard, rounded into the gather shard (on the comm stream)."""
        import torch

        if self.mirror is not None:
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

        local = reduced.view(-1, *self.shape[1:])
        if local.dtype != self.orig_dtype:
            local = local.to(self.orig_dtype)
        with torch.no_grad():
            if self.sharded.grad is None:
                self.sharded.grad = _sharded(local, mesh, self.shape)
            else:
                self.sharded.grad.to_local().add_(local)


def _sharded(local: torch.Tensor, mesh: DeviceMesh, shape: tuple) -> Any:
    """`local` as this rank's rows of a DTensor of `shape`: Shard(0) on the mesh's last dim,
    replicated on the one before (HSDP's 2-D mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape)
    )


def _contiguous(shape: tuple) -> tuple:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(1, d)
    return tuple(reversed(stride))
