"""DistributedDataParallel's part in Join (uneven inputs): the step's sync flag and divisor, the
buffer source, a joined rank's shadow step and the final sync of the last joiner (torch's
`_DDPJoinHook`). One concern, a base of `DistributedDataParallel` (ddp/data_parallel.py)."""

from __future__ import annotations

from typing import Any, Optional

from nccl_ddp.comm.group import ProcessGroup, ReduceOp
from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.ddp.interfaces import GradModule
from nccl_ddp.ddp.join import Join, JoinHook, JoinState, ShadowJoinHook, exchange
from nccl_ddp.ddp.param_sync import broadcast_coalesced
from nccl_ddp.ddp.reducer import Reducer
from nccl_ddp.device.base import Device


class JoinsUnevenInputs:
    """The Joinable side of the wrapper; what it reads is the wrapper's (set by its __init__)."""

    config: DDPConfig
    process_group: ProcessGroup
    device: Device
    reducer: Reducer
    join_state: JoinState
    _adapter: GradModule
    _sync_buffers_next: bool

    def _broadcast_buffers(self, joined: bool) -> None:
        raise NotImplementedError

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """`with ddp.join():` trains with uneven inputs (torch's `DistributedDataParallel.join`)."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return ShadowJoinHook(self, "DistributedDataParallel", kwargs)

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    def _on_step_open(self, syncs: bool) -> None:
        """The reducer opened a step: inside an enabled Join, say so (the count) and whether this
        step all-reduces (the sync flag), and set the step's divisor."""
        if not self.join_state.config.enable:
            self.reducer.step_divisor = None
            return
        active = self._join_count()
        self.reducer.step_divisor = None if self.join_state.divide_by_initial or active is None else active
        exchange(self.process_group, [1 if syncs else 0], "Join's sync flag")

    def _join_count(self) -> Optional[int]:
        """A step opens inside an enabled Join: `Join.notify_join_context` (the torch wrapper
        answers torch's Join with torch's)."""
        return Join.notify_join_context(self)

    def _buffer_source(self, joined: bool) -> int:
        """The rank whose buffers DDP broadcasts: 0, or inside an enabled Join the highest rank
        still training (a joined rank's buffers are stale)."""
        if not self.join_state.config.enable:
            return 0
        group = self.process_group
        (src,) = exchange(group, [-1 if joined else group.rank], "Join's buffer source", ReduceOp.MAX)
        return src

    def join_shadow_step(self) -> None:
        """A joined rank's stand-in for one step of the ranks still training: their buffer
        broadcast when due, then (if their step all-reduces: the sync flag) zeros through the
        reducer's buckets (torch's `_DDPJoinHook`)."""
        group = self.process_group
        (syncs,) = exchange(group, [0], "Join's sync flag")
        if self._sync_buffers_next and self.config.broadcast_buffers:
            self._broadcast_buffers(joined=True)
        self._sync_buffers_next = bool(syncs)
        if not syncs:
            return
        # the ranks still training divide by the group or by themselves (fewer than the group)
        divisor = None if self.join_state.divide_by_initial else max(1, group.size - 1)
        self.reducer.shadow_step(divisor)

    def join_finished(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters, frozen ones and (with broadcast_buffers) buffers
        included, of the last rank to join (torch's _sync_final_model)."""
        group = self.process_group
        (src,) = exchange(group, [group.rank if is_last_joiner else -1], "Join's last joiner", ReduceOp.MAX)
        state = [a for _, a in self._adapter.named_frozen()]
        if self.config.broadcast_buffers:
            state += [a for _, a in self._adapter.named_buffers()]
        with self._adapter.on_compute_stream():
            broadcast_coalesced(
                list(self._adapter.native_params()) + state,
                self.process_group,
                self.device,
                self.config.broadcast_chunk_bytes,
                src=src,
            )
        self._adapter.params_updated()
