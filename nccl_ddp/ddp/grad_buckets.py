"""The reducer's bucket layout and the grad memory laid out by it: which bucket each parameter is
in, the flat buffers (buckets/memory.py), and how the grads relate to them (the reducer's mode):
"view" (the framework's grads alias the buffers), "pack" (they live elsewhere and are packed
in), "python" (PythonReducer: no buffers). A new layout (the first step's rebuild) moves the
grads into new buffers, keeping their values."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import BucketLayout, ParamSpec
from nccl_ddp.buckets.memory import BucketBuffers
from nccl_ddp.ddp.bucket_submit import Mode

log = logging.getLogger(__name__)

InstallFn = Callable[[int, Any], None]
"""install(i, view): make the framework's grad of parameter i alias `view` from now on."""


class GradBuckets:
    """`layout`, `memory` (None under PythonReducer) and, per parameter, `bucket_of[i]` (-1:
    excluded by static_graph; what mark_ready's fast path reads)."""

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        grads: List[Any],
        device: Any,
        rank: int,
        *,
        python: bool,
        install: Optional[InstallFn],
    ) -> None:
        self.specs, self.grads, self.device, self.rank = list(specs), grads, device, rank
        self._python, self._install = python, install
        self.layout: BucketLayout
        self.memory: Optional[BucketBuffers] = None
        self.bucket_of: List[int] = []
        self.unbucketed: List[int] = []
        self._views = False

    @property
    def mode(self) -> Mode:
        if self._python:
            return "python"
        return "view" if self._views else "pack"

    def set(self, layout: BucketLayout) -> None:
        """Allocate buffers for `layout`; in view mode move the grads into bucket views."""
        self.layout = layout
        self.bucket_of = [-1] * len(self.specs)
        for b in layout.buckets:
            for p in b.params:
                self.bucket_of[p] = b.index
        self.unbucketed = [i for i, b in enumerate(self.bucket_of) if b < 0]
        self.memory, self._views = None, False
        if self._python:
            return
        self.memory = BucketBuffers(layout, self.device)
        if self._install is None:  # the framework cannot alias its grads: pack/unpack
            return
        self.memory.adopt_grads(
            self.grads, [s.shape for s in self.specs], self._install, self.device.current_stream()
        )
        self._views = True
        log.debug("rank %d: bucket layout %s (%s mode)", self.rank, layout.summary(), self.mode)

    def zero_(self, stream: Any) -> None:
        """Zero every grad on `stream`: one fill per bucket in view mode, then the rest."""
        rest = self.grads
        if self.mode == "view" and self.memory is not None:
            for buf in self.memory.buffers:
                stream.submit(kernels.zero_, buf)
            rest = [self.grads[i] for i in self.unbucketed]
        for g in rest:
            stream.submit(kernels.zero_, g)
