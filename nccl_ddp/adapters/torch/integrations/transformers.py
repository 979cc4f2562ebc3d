"""Hugging Face transformers: `Trainer`, transformers' with our DDP, so a script changes one line:

    from nccl_ddp.transformers import Trainer        # was: from transformers import Trainer

transformers' Trainer builds its own accelerate `Accelerator` (in `create_accelerator_and_postprocess`,
from the name `transformers.trainer.Accelerator`); this Trainer builds ours there
(adapters/torch/integrations/accelerate.py), whose `prepare` wraps the model in our
`DistributedDataParallel` after
joining our process group beside Accelerate's torch.distributed. Everything else is transformers'
(evaluation, `max_grad_norm`, `save_model`, checkpoints and `resume_from_checkpoint`).
A checkpoint of an nccl_ddp `ZeroRedundancyOptimizer` given as the Trainer's optimizer consolidates
its state on rank 0 first (transformers saves `optimizer.state_dict()` there); resuming loads the
full state on every rank. `with_nccl_ddp(cls)` does the same for any Trainer subclass
(Seq2SeqTrainer, TRL's trainers).
Imported only by `nccl_ddp.transformers`.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Dict, TypeVar

import transformers
import transformers.trainer

from nccl_ddp.adapters.torch.integrations import private_names
from nccl_ddp.adapters.torch.integrations.accelerate import Accelerator
from nccl_ddp.adapters.torch.zero.optimizer import ZeroRedundancyOptimizer
from nccl_ddp.errors import ConfigTypeError

_PATCH = threading.Lock()
T = TypeVar("T", bound=type)


def private_names_present() -> Dict[str, bool]:
    """What the swap relies on -> whether this transformers has it: the module-level name
    `transformers.trainer.Accelerator`, looked up by `Trainer.create_accelerator_and_postprocess`
    when it builds the Trainer's Accelerator."""
    method = getattr(transformers.Trainer, "create_accelerator_and_postprocess", None)
    present = {
        "transformers.trainer.Accelerator": hasattr(transformers.trainer, "Accelerator"),
        "Trainer.create_accelerator_and_postprocess": method is not None,
        "Trainer._save_optimizer_and_scheduler": hasattr(
            transformers.Trainer, "_save_optimizer_and_scheduler"
        ),
    }
    try:
        source = inspect.getsource(method) if method is not None else ""
    except (OSError, TypeError):  # no source installed: nothing more to check against
        return present
    present["the call Accelerator(...) inside Trainer.create_accelerator_and_postprocess"] = (
        "Accelerator(" in source
    )
    return present


private_names.require("transformers", private_names_present())


def with_nccl_ddp(cls: T) -> T:
    """A subclass of `cls` (transformers.Trainer or a subclass of it) whose Accelerator is
    nccl_ddp's; the name and docs stay `cls`'s."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ConfigTypeError(f"with_nccl_ddp takes a transformers.Trainer subclass, got {cls!r}")

    base: Any = cls

    def create_accelerator_and_postprocess(self: Any) -> None:
        with _PATCH:
            theirs = transformers.trainer.Accelerator
            transformers.trainer.Accelerator = Accelerator
            try:
                base.create_accelerator_and_postprocess(self)
            finally:
                transformers.trainer.Accelerator = theirs

    def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
        # a checkpoint of our ZeroRedundancyOptimizer: its full state is built on rank 0 (a
        # collective: transformers runs this on every rank, and saves state_dict() on rank 0)
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if isinstance(opt, ZeroRedundancyOptimizer):
            opt.consolidate_state_dict(to=0)
        base._save_optimizer_and_scheduler(self, output_dir)

    body = {
        "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
        "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
        "__doc__": cls.__doc__,
        "__module__": __name__,
        "__qualname__": cls.__qualname__,
    }
    return type(cls.__name__, (cls,), body)  # type: ignore[return-value]


Trainer = with_nccl_ddp(transformers.Trainer)
