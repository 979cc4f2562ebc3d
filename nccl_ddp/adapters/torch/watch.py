"""Whether a wrapped torch module still has the parameters and buffers it was wrapped with, asked
at every forward: one attribute read per parameter instead of a walk of the module tree.

torch calls process-wide hooks whenever any module registers a parameter, a buffer or a submodule
(`setattr`, `register_*`, `add_module`): a counter of those events says whether the tree may have
changed since the last full look. What registration does not report is checked directly:
`requires_grad` flips, and buffers replaced in their module's dict (`Module._apply`, e.g. `.to()`
on the inner module) or given new storage (`buf.data = ...`). `check_initialized` and
`check_same_params` are the refusals: lazy parameters at wrapping, changed ones at a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, Callable, List, Optional, Sequence, Tuple

from nccl_ddp.arrays.frameworks import NativeArray
from nccl_ddp.ddp.interfaces import Named
from nccl_ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch

Convert = Callable[[str, "torch.Tensor"], NativeArray]
"""(name, buffer) -> the buffer's native array."""

_events = 0  # registrations seen in this process (any module)
_installed = False


def _count(*_: object) -> None:
    global _events
    _events += 1


def _install() -> None:
    """Register the counter once per process (it never changes what is registered)."""
    global _installed
    if _installed:
        return
    from torch.nn.modules import module

    for name in (
        "register_module_parameter_registration_hook",
        "register_module_buffer_registration_hook",
        "register_module_module_registration_hook",
    ):
        getattr(module, name)(_count)
    _installed = True


class ModuleWatch:
    """The wrapped module's trainable parameters (as wrapped) and its buffers (cached natives)."""

    def __init__(self, module: torch.nn.Module, trainable: List[torch.nn.Parameter]) -> None:
        _install()
        self.module = module
        self.trainable = trainable
        self._params_seen = -1
        self._frozen: List[torch.nn.Parameter] = []
        self._buffers_seen = -1
        self._buffer_slots: List[Tuple[dict, str, torch.Tensor, int]] = []
        self._buffers: List[Named] = []
        self.params_checked()

    # ---- parameters
    def params_unchanged(self) -> bool:
        """No registration anywhere since the last full check, and no parameter (un)frozen."""
        if self._params_seen != _events:
            return False
        for p in self.trainable:
            if not p.requires_grad:
                return False
        for p in self._frozen:
            if p.requires_grad:
                return False
        return True

    def params_checked(self) -> None:
        """A full look found the wrapped parameters as they were: remember what it saw."""
        self._params_seen = _events
        self._frozen = [p for p in self.module.parameters() if not p.requires_grad]

    # ---- buffers
    def buffers(self, convert: Convert) -> List[Named]:
        """`[(name, convert(name, buffer))]` as `module.named_buffers()` lists them, converted
        again only when a buffer was added, replaced or given new storage."""
        if not self._buffers_unchanged():
            self._list_buffers(convert)
        return self._buffers

    def _buffers_unchanged(self) -> bool:
        if self._buffers_seen != _events:
            return False
        for slots, name, b, ptr in self._buffer_slots:
            if b.data_ptr() != ptr or slots.get(name) is not b:
                return False
        return True

    def _list_buffers(self, convert: Convert) -> None:
        seen_events = _events
        slots, named, memo = [], [], set()
        for prefix, m in self.module.named_modules():
            for name, b in m._buffers.items():
                if b is None or id(b) in memo:  # named_buffers() lists a shared one once
                    continue
                memo.add(id(b))
                full = f"{prefix}.{name}" if prefix else name
                named.append((full, convert(full, b)))
                # (the converted view keeps the old storage alive, so new storage cannot reuse
                # its address: a changed data_ptr always shows)
                slots.append((m._buffers, name, b, b.data_ptr()))
        self._buffer_slots, self._buffers, self._buffers_seen = slots, named, seen_events


def check_initialized(module: torch.nn.Module) -> None:
    """Lazy modules (LazyLinear, LazyConv2d) have no shapes until their first forward."""
    from torch.nn.parameter import is_lazy

    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for n, t in named:
            if is_lazy(t):
                raise ConfigError(
                    f"{kind} {n!r} is uninitialized (a lazy module such as LazyLinear creates it "
                    "at its first forward): run one forward pass on the module (e.g. with a dummy "
                    "batch) before wrapping it in DistributedDataParallel"
                )


def check_same_params(
    module: torch.nn.Module,
    params: Sequence[Any],
    names: Sequence[Optional[str]],
    sparse: AbstractSet[int],
    rank: int,
) -> None:
    """Parameters added, replaced or unfrozen after wrapping would silently not be reduced
    (their grads differ across ranks): refused at the next step. `sparse`: ids of the
    parameters reduced as sparse, outside `params`."""
    now = [p for p in module.parameters() if p.requires_grad and id(p) not in sparse]
    if len(now) == len(params) and all(a is b for a, b in zip(now, params)):
        return
    wrapped = set(map(id, params)) | set(sparse)
    added = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in wrapped]
    alive = set(map(id, now))
    gone = [n for n, p in zip(names, params) if id(p) not in alive]
    raise ConfigError(
        f"rank {rank}: the module's trainable parameters changed after "
        f"it was wrapped in DistributedDataParallel (new or unfrozen: {added or 'none'}; "
        f"removed, replaced or frozen: {gone or 'none'}). DDP reduces the parameters it found "
        "when it was built: add, replace or (un)freeze parameters before wrapping, or wrap the "
        "module again"
    )
