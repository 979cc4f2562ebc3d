"""Run in every Python process of one test of torch's FSDP2 file (the pytest process and the ranks
FSDPTest spawns), from the `sitecustomize.py` that tests/support/torch_fsdp_file.py writes in a
temporary folder on their PYTHONPATH:

- NCCL_DDP_FSDP_FILE_ACCEL=N: `torch.accelerator.device_count()` answers N. torch 2.13's
  `FSDPTest._run` skips a test whose world size exceeds it, `allow_cpu` notwithstanding, so on a
  CPU-only machine every multi-process test would be skipped.
- NCCL_DDP_FSDP_FILE_WHO=ours: our fully_shard where torch's test file imports torch's
  (`torch.distributed.fsdp`, its `_composable` alias and `_fully_shard`), before that file is
  imported. Our FSDPModule subclasses torch's, so the file's isinstance checks hold unchanged.
  `torch` (or unset) changes nothing: the reference run.
"""

from __future__ import annotations

import importlib
import os

ACCEL = "NCCL_DDP_FSDP_FILE_ACCEL"
WHO = "NCCL_DDP_FSDP_FILE_WHO"
WHOS = ("torch", "ours")

# where torch's test files find fully_shard (each is re-bound if the process has it)
_FULLY_SHARD_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp._fully_shard",
)


def fake_accelerator_count(n: int) -> None:
    """`torch.accelerator.device_count()` answers `n` in this process."""
    import torch

    torch.accelerator.device_count = lambda: n


def ours_in_torchs_place() -> None:
    """nccl_ddp.fully_shard bound wherever torch's test files import torch's from."""
    import nccl_ddp

    for name in _FULLY_SHARD_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older or newer torch without that alias
            continue
        module.fully_shard = nccl_ddp.fully_shard  # type: ignore[attr-defined]


def apply_from_env() -> None:
    """What the environment asks for; a value it does not know is an error in every process."""
    who = os.environ.get(WHO, "torch")
    if who not in WHOS:
        raise ValueError(f"{WHO}={who!r}: expected one of {', '.join(WHOS)}")
    accel = os.environ.get(ACCEL, "")
    if accel:
        if not accel.isdigit():
            raise ValueError(f"{ACCEL}={accel!r}: expected a number of devices")
        fake_accelerator_count(int(accel))
    if who == "ours":
        ours_in_torchs_place()
