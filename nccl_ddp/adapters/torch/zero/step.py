"""The grads one `ZeroRedundancyOptimizer.step()` reads, per piece of this rank's shards, and what
is done to them before the step: the global norm, clipping, GradScaler's unscaling.

ZeRO-1 (torch's contract): `p.grad` holds the full averaged grad, and a piece's grad is a view of
the owned range of `p.grad` (widened into the piece's fp32 buffer only for low-precision grads);
clipping scales `p.grad` itself, as torch's `clip_grad_norm_` does. ZeRO-2: the reduced shards
(`ZeroShards.collect_reduced`). Either way the global norm is one all-reduce of this rank's
squared norm, computed once per step and reused (clipping, the non-finite skip, GradScaler's
found_inf), so every rank takes the same decisions.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from nccl_ddp.zero.layout import Piece
from nccl_ddp.zero.shards import ZeroShards


class StepGrads:
    """`order`: the layout's parameters (torch tensors); `buffers[k]`: piece k's fp32 grad
    buffer as a tensor (ZeRO-2: a view of the grad shard; ZeRO-1: None for fp32 buckets)."""

    def __init__(
        self,
        stage: int,
        shard_memory: ZeroShards,
        order: List[torch.nn.Parameter],
        buffers: List[Optional[torch.Tensor]],
    ) -> None:
        self.stage, self.shard_memory, self.order, self.buffers = stage, shard_memory, order, buffers
        self.pieces = shard_memory.pieces
        self.grads: List[
            Optional[torch.Tensor]
        ] = []  # this step's, per piece (None: the parameter has no grad)
        self._collected = False
        self._norm: Optional[float] = None

    def reset(self) -> None:
        """A new step (after `step()` or `zero_grad()`): collect again, no norm known."""
        self.grads, self._collected, self._norm = [], False, None

    @torch.no_grad()
    def collect(self) -> List[Optional[torch.Tensor]]:
        if not self._collected:
            if self.stage == 2:
                self.shard_memory.collect_reduced()
                self.grads = list(self.buffers)
            else:
                self.grads = [self._full_grad_piece(pc, buf) for pc, buf in zip(self.pieces, self.buffers)]
            self._collected, self._norm = True, None
        return self.grads

    def _full_grad_piece(self, pc: Piece, buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        g = self.order[pc.param].grad
        if g is None:
            return None
        flat = g.reshape(-1)[pc.param_lo : pc.param_hi]
        if buf is None and flat.dtype == torch.float32:
            return flat
        if buf is None:  # (a grad in another dtype than its parameter's bucket)
            return flat.float()
        buf.copy_(flat)
        return buf

    def global_norm(self) -> float:
        """The 2-norm of the whole grad over every rank (NaN/Inf when any rank's is not
        finite); one all-reduce, then cached until the grads change."""
        self.collect()
        if self._norm is None:
            if self.stage == 2:
                self._norm = self.shard_memory.global_norm()
            else:
                present = [g for g in self.grads if g is not None]
                sq = torch.stack(torch._foreach_norm(present)).double().pow(2).sum() if present else 0.0
                self._norm = self.shard_memory.global_norm(local_sq=float(sq))
        return self._norm

    @torch.no_grad()
    def scale_(self, factor: float) -> None:
        """Multiply this step's grads by `factor` (ZeRO-1: `p.grad` itself, so it stays the grad
        torch's tools see, and the widened copies)."""
        self.collect()
        if self.stage == 2:
            self.shard_memory.scale_grads(factor)
        else:
            full = [p.grad for p in self.order if p.grad is not None]
            if full:
                torch._foreach_mul_(full, factor)
            copies = [g for g, buf in zip(self.grads, self.buffers) if g is not None and g is buf]
            if copies:
                torch._foreach_mul_(copies, factor)
        if self._norm is not None:
            self._norm *= factor

    def clip_(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s rule on the global norm; returns the norm."""
        total = self.global_norm()
        coef = float(max_norm) / (total + 1e-6)
        if coef < 1.0 and math.isfinite(total):
            self.scale_(coef)
        return total

    def unscale_and_check(self, inv_scale: float) -> bool:
        """GradScaler's unscale-and-check: True when any rank's grad is non-finite."""
        if inv_scale != 1.0:
            self.scale_(inv_scale)
        return not math.isfinite(self.global_norm())
