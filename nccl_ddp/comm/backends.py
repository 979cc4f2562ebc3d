"""Backend names: ours ("host", "nccl") and torch.distributed's, which scripts pass through
unchanged (`init_process_group(backend="gloo")`, nanoGPT's `backend="nccl"`, `dist.get_backend()`).

    "host", "gloo"                  -> "host"  (torch's CPU backend; ours is the host backend)
    "nccl"                          -> "nccl"
    "cpu:gloo", "cuda:nccl"         -> "host", "nccl"
    "cpu:gloo,cuda:nccl"            -> None    (torch picks per tensor; one group of ours has one
                                                backend: the automatic choice, nccl on a GPU)
    None                            -> None    (automatic)

Case is ignored, as torch does. Anything else (torch's "mpi", "ucc", a typo) is refused, naming the
value and the names that work.
"""

from __future__ import annotations

from typing import Any, Optional

from nccl_ddp.errors import ConfigError, ConfigTypeError

BACKENDS = ("host", "nccl")
_ALIASES = {"host": "host", "gloo": "host", "nccl": "nccl"}
_DEVICE_BACKEND = {"cpu": ("gloo", "host"), "cuda": ("nccl", "nccl")}  # torch's pairs we accept


def backend_name(backend: Any) -> Optional[str]:
    """Our backend for `backend` (ours or torch's spelling); None: choose automatically."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise ConfigTypeError(
            f"init_process_group: backend must be a string or None, got {type(backend).__name__} {backend!r}"
        )
    text = backend.strip().lower()
    if ":" not in text:
        if text in _ALIASES:
            return _ALIASES[text]
        raise _unknown(backend)
    chosen = set()
    for pair in text.split(","):
        device, _, name = (s.strip() for s in pair.partition(":"))
        if _DEVICE_BACKEND.get(device, ("",))[0] != name:
            raise _unknown(backend)
        chosen.add(_DEVICE_BACKEND[device][1])
    return chosen.pop() if len(chosen) == 1 else None


def _unknown(backend: str) -> ConfigError:
    return ConfigError(
        f"init_process_group: unknown backend {backend!r}; use 'host' (torch's 'gloo'), 'nccl', "
        f"torch's 'cpu:gloo,cuda:nccl' (automatic), or None (automatic: 'nccl' on a GPU, else 'host')"
    )
