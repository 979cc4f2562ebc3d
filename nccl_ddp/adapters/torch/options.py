"""torch DDP's keyword arguments beside the core's (`device_ids`, `output_device`, `dim`,
`gradient_as_bucket_view`, ...): which are accepted, and the single-device contract they state.
One concern: checking what `TorchDistributedDataParallel.__init__` is given, before it builds."""

from __future__ import annotations

from typing import Any

import torch

from nccl_ddp.comm.api import resolve_group
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool

# torch's arguments that need a feature we do not have: name -> (the value that is fine, why)
_UNSUPPORTED = {
    "mixed_precision": (None, "use torch.autocast (or cast the model) instead"),
    "device_mesh": (None, "pass its data-parallel group (a torch group or ours) as process_group"),
    "delay_all_reduce_named_params": (None, "every parameter is reduced as its grad is ready"),
    "param_to_hook_all_reduce": (None, "every parameter is reduced as its grad is ready"),
    "skip_all_reduce_unused_params": (
        False,
        ("unused parameters are reduced as zeros, as by default in torch"),
    ),
    "forward_sync_buffers": (
        True,
        (
            "use broadcast_buffers=False to keep buffers per rank "
            "(which also skips their broadcast at construction)"
        ),
    ),
}


def check_torch_options(options: dict, dim: Any, gradient_as_bucket_view: Any, check_reduction: Any) -> None:
    """torch DDP's own keyword arguments: those we cannot honour are a ConfigError saying why."""
    for name, value in options.items():
        if name not in _UNSUPPORTED:
            raise ConfigTypeError(f"DistributedDataParallel got an unexpected keyword argument {name!r}")
        fine, why = _UNSUPPORTED[name]
        if value != fine:
            raise ConfigError(
                f"{name}={value!r} is not supported by nccl_ddp's "
                f"DistributedDataParallel (only {fine!r}): {why}"
            )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ConfigTypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
    check_bool("check_reduction", check_reduction)


def device_ids_of(module: Any, device_ids: Any, output_device: Any, process_group: Any) -> tuple:
    """torch's single-device contract: device_ids None for a CPU module, [the module's GPU] for a
    GPU one; output_device None or that GPU."""
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        if output_device is not None:
            raise ConfigError(
                f"output_device={output_device!r} needs device_ids=[...]; the "
                "output stays where the module computes it"
            )
        return None, None
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ConfigError(
            f"device_ids must be None or a list of one GPU (this process's), got "
            f"{device_ids!r}: one process drives one device, as in torch DDP"
        )
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ConfigError(
            f"device_ids={device_ids!r} is for a module on one GPU, but its "
            f"parameters are on {sorted(map(str, devices))}: pass device_ids=None "
            "for a CPU module (or move the module to the GPU first)"
        )
    index = _device_index(device_ids[0], "device_ids[0]")
    (device,) = devices
    if index != device.index:
        raise ConfigError(
            f"device_ids={device_ids!r}, but the module's parameters are on "
            f"{device}: move the module to cuda:{index} (model.to(device_ids[0])) "
            "before wrapping it"
        )
    group_device = getattr(resolve_group(process_group, "process_group"), "device_id", None)
    if group_device is not None and group_device != index:
        raise ConfigError(
            f"device_ids={device_ids!r}, but this process's nccl_ddp group "
            f"communicates on cuda:{group_device} (its LOCAL_RANK): use that GPU"
        )
    if output_device is not None and _device_index(output_device, "output_device") != index:
        raise ConfigError(
            f"output_device={output_device!r} differs from device_ids[0]; the "
            "output stays on the module's GPU, as in torch's single-device DDP"
        )
    return [index], index


def _device_index(d: Any, what: str) -> int:
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    try:
        device = torch.device(d)
    except (TypeError, RuntimeError) as e:
        raise ConfigTypeError(f"{what} must be a GPU index or a CUDA device, got {d!r}") from e
    if device.type != "cuda":
        raise ConfigError(f"{what} must be a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()
