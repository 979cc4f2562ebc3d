"""`overlap_param_gather=True`: every use of the model's parameters waits for their all-gather.

`step()` returns with the parameter all-gathers queued (one per bucket), so the gather hides behind
the next forward; until then the parameters hold a mix of old and new values. `GatherWaits` makes
every reader wait first:
- forward: a pre-hook per module waits for the buckets it needs. Where those waits go is learned on
  the first forward: each module's own parameters are waited for at that module when its forward
  ran, else at its nearest ancestor whose forward ran (a parent doing `F.linear(x,
  self.a.weight)` without calling `self.a` waits for `a`'s buckets). Until learned, every
  module's pre-hook waits for all buckets.
- `state_dict()` / `load_state_dict()` of any module of the model: all buckets first, so nothing
  half-gathered is saved and no load is overwritten by an older gather.
The optimizer's `wait_for_params()`, `consolidate_state_dict` and `load_state_dict` wait too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Set

from nccl_ddp.zero.shards import ZeroShards

if TYPE_CHECKING:
    import torch


class GatherWaits:
    """The hooks above on every module of `root`; `index`: id(param) -> layout index."""

    def __init__(self, shard_memory: ZeroShards, root: torch.nn.Module, index: Dict[int, int]) -> None:
        self.shard_memory, self.root = shard_memory, root
        modules = list(root.modules())
        self._parent: Dict[int, torch.nn.Module] = {}
        for m in modules:
            for c in m.children():
                self._parent.setdefault(id(c), m)
        layout = shard_memory.layout
        self._own: Dict[int, List[int]] = {}
        for m in modules:
            located = [layout.locate(index[id(p)]) for p in m.parameters(recurse=False) if id(p) in index]
            buckets = sorted({loc[0] for loc in located if loc is not None})
            if buckets:
                self._own[id(m)] = buckets
        self._modules = {id(m): m for m in modules}
        self._waits: Dict[int, List[int]] = {}
        self._ran: Optional[Set[int]] = set()  # learning: modules whose forward ran
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._before_forward))
            self._handles.append(m.register_state_dict_pre_hook(self._wait_all))
            self._handles.append(m.register_load_state_dict_pre_hook(self._wait_all))
        self._handles.append(root.register_forward_hook(self._after_root_forward))

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._ran is not None:
            self._ran.add(id(module))
            self.shard_memory.wait_all()
            return
        if self.shard_memory.gather_pending:
            for b in self._waits.get(id(module), ()):
                self.shard_memory.wait_bucket(b)

    def _after_root_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._ran is None:
            return
        waits: Dict[int, Set[int]] = {}
        for mid, buckets in self._own.items():
            at = self._modules[mid]
            while at is not None and id(at) not in self._ran:
                at = self._parent.get(id(at))
            waits.setdefault(id(self.root if at is None else at), set()).update(buckets)
        self._waits = {mid: sorted(bs) for mid, bs in waits.items()}
        self._ran = None

    def _wait_all(self, *args: object, **kwargs: object) -> None:
        self.shard_memory.wait_all()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
