"""The reducer's bucket layout and the grad memory laid out by it: which bucket each parameter is
in, the flat buffers (buckets/memory.py), and how the grads relate to them (the reducer's mode):
"view" (the framework's grads alias the buffers), "pack" (they live elsewhere and are packed
in), "per_grad" (reducer_mode="PythonReducer": no buffers). `pooled` (ZeRO-2 over a framework
that hands its own grads each step): "pack" without buffers of its own, the shard core's
`GradPool` is packed into. A new layout (the first step's rebuild) moves the grads into new
buffers, keeping their values."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from nccl_ddp import kernels
from nccl_ddp.buckets.layout import BucketLayout, ParamSpec
from nccl_ddp.buckets.memory import BucketBuffers, copy_into, copy_of
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.bucket_submit import Mode
from nccl_ddp.device import Device, Stream

log = logging.getLogger(__name__)

InstallFn = Callable[[int, Any], None]
"""install(i, view): make the framework's grad of parameter i alias `view` from now on."""


class GradBuckets:
    """`layout`, `memory` (None per grad) and, per parameter, `bucket_of[i]` (-1:
    excluded by static_graph; what mark_ready's fast path reads)."""

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        grads: List[Any],
        device: Device,
        group: ProcessGroup,
        *,
        per_grad: bool,
        install: Optional[InstallFn],
    ) -> None:
        self.specs, self.grads, self.device, self.rank = list(specs), grads, device, group.rank
        # bucket memory from the group: shared on the host's shm transport (peers read it in place)
        self._zeros = functools.partial(group.zeros, device)
        self._per_grad, self._install = per_grad, install
        self.pooled = False  # set by the reducer before the first layout (see the module doc)
        self.layout: BucketLayout
        self.memory: Optional[BucketBuffers] = None
        self.bucket_of: Sequence[int] = ()  # the layout's, read on mark_ready's fast path
        self.unbucketed: Sequence[int] = ()
        self._views = False

    @property
    def mode(self) -> Mode:
        if self._per_grad:
            return "per_grad"
        return "view" if self._views else "pack"

    def set(self, layout: BucketLayout) -> None:
        """Allocate buffers for `layout`; in view mode move the grads into bucket views."""
        self.layout = layout
        self.bucket_of, self.unbucketed = layout.bucket_of, layout.unbucketed
        self.memory, self._views = None, False
        if self.pooled:  # no grads of ours: the framework hands them in each step
            self.release()
        if self._per_grad or self.pooled:
            return
        self.memory = BucketBuffers(layout, self.device, self._zeros)
        if self._install is None:  # the framework cannot alias its grads: pack/unpack
            return
        self.memory.adopt_grads(
            self.grads, [s.shape for s in self.specs], self._install, self.device.current_stream()
        )
        self._views = True
        log.debug("rank %d: bucket layout %s (%s mode)", self.rank, layout.summary(), self.mode)

    def rearrange(self, layout: BucketLayout) -> None:
        """Refill the buckets in `layout` (the first step's arrival order), if it differs."""
        if layout.buckets != self.layout.buckets:
            self.set(layout)
            log.info("rank %d: buckets rebuilt in arrival order: %s", self.rank, layout.summary())

    def release(self) -> None:
        """Pooled: `grads[i]` is set by the framework's hook before `mark_ready(i)` (its own
        grad array) and dropped here once a synchronised step has reduced it (the compute stream
        has waited for every bucket that read it: the framework may free or reuse its memory)."""
        for i in range(len(self.grads)):
            self.grads[i] = None

    def step_read(self) -> None:
        """The compute stream has waited for every bucket of a synchronised step."""
        if self.pooled:
            self.release()

    def copies(self, indices: Sequence[int], stream: Stream) -> Dict[int, Any]:
        """Copies (on `stream`) of grads reduced without a grad this step (find_unused), to be
        restored if no rank used them; pooled: none (they were reduced as zeros, none kept)."""
        if self.pooled:
            return {}
        return {i: copy_of(self.device, stream, self.grads[i]) for i in indices}

    def restore(self, indices: Sequence[int], saved: Dict[int, Any], stream: Stream) -> None:
        for i in indices:
            if i in saved:
                stream.submit(copy_into, self.grads[i], saved[i])

    def grad_for_pack(self, i: int) -> Any:
        """Grad i as the pack reads it; pooled, one not handed in this step is reduced as zeros."""
        g = self.grads[i]
        if g is None:
            spec = self.specs[i]
            g = self.device.zeros(int(np.prod(spec.shape, dtype=np.int64)), spec.dtype).reshape(spec.shape)
        return g

    def zero_(self, stream: Stream) -> None:
        """Zero every grad on `stream`: one fill per bucket in view mode, then the rest."""
        rest = self.grads
        if self.mode == "view" and self.memory is not None:
            for buf in self.memory.buffers:
                stream.submit(kernels.zero_, buf)
            rest = [self.grads[i] for i in self.unbucketed]
        for g in rest:
            if g is not None:  # (pooled: a grad not handed in this step)
                stream.submit(kernels.zero_, g)
