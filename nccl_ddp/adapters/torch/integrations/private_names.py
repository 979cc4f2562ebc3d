"""The private names of Lightning and Accelerate that our glue relies on, checked when the glue is
imported. Our `NcclDDPStrategy` overrides Lightning's private `DDPStrategy._setup_model` and
`_register_ddp_hooks` and subclasses `_DDPForwardRedirection`; our Accelerator swaps
`torch.nn.parallel.DistributedDataParallel` while accelerate's `prepare_model` looks the name up;
our transformers Trainer swaps `transformers.trainer.Accelerator` while
`Trainer.create_accelerator_and_postprocess` looks it up.
A release that renames one would not fail: Lightning or accelerate would silently wrap the model in
torch's DDP again. So the glue refuses to load instead, naming what is gone and the version we
test (`TESTED`, the upper bound of the extra in pyproject.toml)."""

from __future__ import annotations

from importlib import metadata
from typing import Dict

from nccl_ddp.errors import FrameworkVersionError

TESTED = {"lightning": "2.6.6", "accelerate": "1.15.0", "transformers": "5.24.0"}
"""The newest version of each glue library CI runs against (the extras' upper bounds)."""


def missing(present: Dict[str, bool]) -> list:
    """The names in `present` (private name -> whether the installed library has it) that are gone."""
    return [name for name, ok in present.items() if not ok]


def require(library: str, present: Dict[str, bool]) -> None:
    """Raises FrameworkVersionError naming every private name of `library` that is gone."""
    gone = missing(present)
    if not gone:
        return
    try:
        installed = metadata.version(library)
    except metadata.PackageNotFoundError:
        installed = "(version unknown)"
    raise FrameworkVersionError(
        f"nccl_ddp's {library} glue relies on {library}'s private "
        f"{'names' if len(gone) > 1 else 'name'} {', '.join(gone)}, which {library} {installed} "
        f"no longer has; nccl_ddp is tested with {library} {TESTED[library]}: "
        f"pip install '{library}<={TESTED[library]}'"
    )
