"""Where a `fully_shard` unit lives: the one device of its parameters, our device and group for
them (the host backend for CPU parameters, the GPU of the NCCL communicator for CUDA ones), the
DeviceMesh its DTensors live on, and the offload policy that placement allows. Each check names
the rank and says what to do."""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from nccl_ddp.adapters.torch.fsdp.param import Slot
from nccl_ddp.adapters.torch.groups import ours_for
from nccl_ddp.comm.api import device_of
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.device import Device, HostDevice
from nccl_ddp.errors import ConfigError


def param_device(found: List[Tuple[str, List[Slot], Any]], rank: int) -> torch.device:
    """The one device every parameter of the unit is on (the CPU when it has none; a meta
    parameter is sharded on the CPU, where `module.to_empty(device="cpu")` materialises it)."""
    devices = {torch.device("cpu") if p.is_meta else p.device for _, _, p in found}
    if len(devices) > 1:
        named = ", ".join(f"{fqn!r} on {p.device}" for fqn, _, p in found[:8])
        raise ConfigError(
            f"rank {rank}: fully_shard got parameters on several devices ({named}): move the "
            "module to one device (module.to(device)) first"
        )
    where = next(iter(devices)) if devices else torch.device("cpu")
    if where.type not in ("cpu", "cuda"):
        fqn = found[0][0]
        raise ConfigError(
            f"rank {rank}: parameter {fqn!r} is on {where}: nccl_ddp's fully_shard shards CPU "
            "tensors (host backend) and CUDA tensors (nccl backend) only"
        )
    return where


def device_for(where: torch.device, group: ProcessGroup, rank: int) -> Device:
    """Our device for parameters on `where`: the host for CPU ones, the GPU of the group's
    NCCL communicator for CUDA ones (which must be the parameters' GPU)."""
    if where.type == "cpu":
        if group.backend == "nccl":
            raise ConfigError(
                f"rank {rank}: fully_shard got CPU parameters but the group {group.name!r} is "
                "nccl_ddp's nccl backend: move the module to its GPU (module.cuda(local_rank)), "
                "or use the host backend (torch's gloo) for CPU training"
            )
        return HostDevice()
    if group.backend != "nccl":
        raise ConfigError(
            f"rank {rank}: fully_shard got parameters on {where} but the group {group.name!r} "
            f"is nccl_ddp's {group.backend!r} backend: initialise torch.distributed with "
            "'nccl' (or nccl_ddp.init_process_group('nccl')) for CUDA parameters"
        )
    device = device_of(group)
    gpu = getattr(device, "device_id", None)
    if where.index is not None and gpu != where.index:
        raise ConfigError(
            f"rank {rank}: fully_shard got parameters on {where} but this rank's NCCL "
            f"communicator runs on GPU {gpu}: move the module to cuda:{gpu} (the local rank's "
            "GPU), or set the device before initialising the process group"
        )
    return device


def mesh_for(mesh: Any, group: Any, rank: int, kind: str) -> Any:
    """The DeviceMesh the DTensors live on (1-D, or 2-D for HSDP), of device type `kind`
    (the parameters': "cpu" or "cuda")."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise ConfigError(
            f"rank {rank}: fully_shard needs torch.distributed initialised (its DTensors live on a "
            "DeviceMesh): call torch.distributed.init_process_group('gloo') first"
        )
    if mesh is not None and group is not None:
        raise ConfigError(f"rank {rank}: pass mesh= or group= to fully_shard, not both")
    if mesh is None and group is None:
        return init_device_mesh(kind, (dist.get_world_size(),))
    if mesh is None:
        if isinstance(group, dist.ProcessGroup):
            return DeviceMesh.from_group(group, kind)
        return DeviceMesh(kind, list(group.ranks))
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ConfigError(
            f"rank {rank}: fully_shard takes a 1-D DeviceMesh (shard) or a 2-D one (HSDP: "
            f"replicate on dim 0, shard on dim 1), got {mesh!r}"
        )
    if mesh.device_type != kind:
        raise ConfigError(
            f"rank {rank}: fully_shard got a {mesh.device_type!r} DeviceMesh for parameters on "
            f"{kind} (meta parameters are sharded on the CPU): build the mesh with "
            f"init_device_mesh({kind!r}, ...), or the model on the mesh's device"
        )
    return mesh


def ours_on(mesh: Any, dim: int, rank: int) -> ProcessGroup:
    """Our group over the ranks of the mesh's dimension `dim` that hold this rank."""
    ours = ours_for(mesh.get_group(dim), "fully_shard(mesh=...)")
    if ours is None:  # mesh.get_group() is a torch group: ours_for always answers for one
        raise ConfigError(f"rank {rank}: fully_shard found no nccl_ddp group for the mesh {mesh}")
    return ours


def check_offload(policy: Any, device_type: str, rank: int) -> None:
    """torch's `OffloadPolicy()` offloads nothing; `CPUOffloadPolicy` keeps the shards, grads and
    optimizer step in host memory, where the host path (CPU or meta parameters) keeps them
    anyway, so it changes nothing there. Offloading a GPU's parameters is not built."""
    name = type(policy).__name__
    host = device_type in ("cpu", "meta")
    if policy is None or name == "OffloadPolicy" or (name == "CPUOffloadPolicy" and host):
        return
    raise ConfigError(
        f"rank {rank}: fully_shard(offload_policy={policy!r}) is not supported for parameters on "
        f"{device_type}: nccl_ddp does not offload GPU parameters (CPUOffloadPolicy is accepted for "
        "CPU parameters, which stay in host memory anyway)"
    )


def shard_dims(fn: Any, found: List[Tuple[str, List[Slot], Any]], rank: int) -> List[int]:
    """The dim each parameter is sharded along: `fn(param)` (torch's `shard_placement_fn`) returns
    `Shard(dim)` or None (dim 0; no `fn`: all dim 0). A negative dim counts from the end, as
    torch's; anything else is refused naming the rank, the parameter and what to return."""
    if fn is None:
        return [0] * len(found)
    if not callable(fn):
        raise ConfigError(
            f"rank {rank}: fully_shard(shard_placement_fn={fn!r}) must be a callable taking a "
            "parameter and returning Shard(dim) or None"
        )
    from torch.distributed.tensor import Shard

    dims = []
    for fqn, _, p in found:
        got = fn(p)
        if got is None:
            dims.append(0)
            continue
        if type(got) is not Shard:  # _StridedShard (a Shard), ShardPlacementResult (its own mesh), ...
            raise ConfigError(
                f"rank {rank}: shard_placement_fn returned {got!r} for parameter {fqn!r}: nccl_ddp's "
                "fully_shard takes Shard(dim) (on fully_shard's mesh) or None (Shard(0)); return one of those"
            )
        dim = got.dim + p.dim() if got.dim < 0 else got.dim
        if not 0 <= dim < p.dim():
            raise ConfigError(
                f"rank {rank}: shard_placement_fn returned {got!r} for parameter {fqn!r} of shape "
                f"{tuple(p.shape)}, which has no dim {got.dim}: return Shard(d) with "
                f"-{p.dim()} <= d < {p.dim()}"
            )
        dims.append(dim)
    return dims
