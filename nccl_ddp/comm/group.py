"""The backend interface: `ProcessGroup` (one per group of ranks), `Work` handles and `ReduceOp`.

Backends (`host/backend.py`, `nccl/backend.py`) implement `ProcessGroup`; everything above
`comm/` talks to this interface only. Buffers are the backend's native arrays: NumPy for "host",
CuPy for "nccl"; conversion from other frameworks happens in `comm/collectives.py` through DLPack.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from typing import Any, Callable, Iterator, Optional, Sequence

from nccl_ddp.device import Device, Stream
from nccl_ddp.errors import ConfigError, NcclDdpError, RankMismatchError


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        try:
            return op if isinstance(op, ReduceOp) else cls(str(op).lower())
        except ValueError:
            raise ConfigError(f"unknown reduce op {op!r}; use one of {[o.value for o in cls]}") from None


class Work(abc.ABC):
    """Handle of an asynchronous collective. Keeps its buffers alive until it completes."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until done (host backend) or until the caller's current stream waits for it (nccl).

        Raises `CommTimeout` after `timeout` seconds (None: the group's default timeout) and
        `CommError` if the collective failed. Returns True.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the collective has finished (or failed: `wait` then raises)."""

    @abc.abstractmethod
    def result(self) -> Any:
        """The output array(s); waits first."""


class ProcessGroup(abc.ABC):
    """A set of ranks that run collectives together, in the same order on every member.

    `stream`: where the collective is ordered. On "nccl" a device Stream (None: the group's comm
    stream); on "host" a `device.HostStream` (None: the group's own worker thread). Either way the
    collective runs after the work already submitted to that stream, and work submitted to the
    stream afterwards runs after it. Submit a group's collectives from one stream at a time.

    `tag`: what the buffer is, for error messages ("bucket 3 (1.0 MiB)"): a failure or timeout
    raises `CommError` / `CommTimeout` naming the op, the tag, the group and the rank.
    """

    backend: str  # "host" | "nccl"
    rank: int  # this process's rank within the group
    size: int  # number of ranks in the group
    ranks: tuple  # global ranks of the members, in group-rank order
    timeout: float  # default seconds for blocking waits
    name: str  # for error messages: "world", "group[0,2]", ...

    def fuses_premul_sum(self, device: Device) -> bool:
        """Whether `all_reduce_premul_sum` on `device`'s buffers scales as it sums, so the scale
        costs no pass of its own (the reducer then asks for it instead of scaling first). The
        device is the group's concern, not its caller's: a backend answers for each it serves.
        False here: callers scale, then all-reduce."""
        return False

    def all_reduce_premul_sum(
        self, buf: Any, factor: float, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> Work:
        """buf = the sum over ranks of `factor` * buf (NCCL's ncclRedOpCreatePreMulSum), with the
        bits of scaling each rank's buffer by `factor` (`kernels.scale_`) and then summing. Only
        where `fuses_premul_sum`; elsewhere callers scale first and all-reduce."""
        raise NotImplementedError(f"{type(self).__name__} has no fused pre-multiplied sum")

    def fuses_compression(self, device: Device, compression: str) -> bool:
        """Whether `all_reduce_compressed` on `device`'s float32 buffers gives the bits of a
        `compression` ("float16") hook's pack, all-reduce and unpack more cheaply than those
        three steps (the reducer then asks for it). False here."""
        return False

    def all_reduce_compressed(
        self,
        buf: Any,
        factor: float,
        compression: str,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> Work:
        """float32 `buf` = what packing it into `compression` with `factor`, all-reducing that
        and widening it back would give. Only where `fuses_compression`."""
        raise NotImplementedError(f"{type(self).__name__} has no fused compressed all-reduce")

    def gathers_in_parts(self, device: Device) -> bool:
        """Whether `all_gather_parts` on `device`'s buffers hands the caller every rank's input
        without first gathering them into one buffer (the caller copies out of them what it
        needs: one copy instead of two). False here: callers all-gather, then copy out."""
        return False

    def all_gather_parts(
        self,
        inp: Any,
        apply: Callable[[Sequence[Any]], None],
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> Work:
        """`apply(parts)` in the collective's place on `stream`, `parts[j]` rank j's `inp`
        (read-only, valid only during the call: a peer's own memory where the backend can map
        it). Only where `gathers_in_parts`."""
        raise NotImplementedError(f"{type(self).__name__} has no all_gather_parts")

    def zeros(self, device: Device, n: int, dtype: Any) -> Any:
        """A zero-filled buffer of `n` `dtype` for this group's collectives (a bucket's): here
        `device.zeros`; the host backend's shm transport gives memory its peers read in place."""
        return device.zeros(n, dtype)

    @abc.abstractmethod
    def all_reduce(
        self,
        buf: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> Work:
        """Reduce `buf` across the group, in place."""

    @abc.abstractmethod
    def broadcast(
        self, buf: Any, root: int = 0, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> Work:
        """Copy `buf` of group rank `root` into `buf` on every rank, in place."""

    @abc.abstractmethod
    def all_gather(
        self, out: Any, inp: Any, stream: Optional[Stream] = None, *, tag: Optional[str] = None
    ) -> Work:
        """`out` (flat, size * inp.size elements) receives every rank's `inp`, in rank order."""

    @abc.abstractmethod
    def reduce_scatter(
        self,
        out: Any,
        inp: Any,
        op: ReduceOp = ReduceOp.SUM,
        stream: Optional[Stream] = None,
        *,
        tag: Optional[str] = None,
    ) -> Work:
        """`inp` (flat, size * out.size) is reduced; rank r gets chunk r in `out`."""

    @abc.abstractmethod
    def barrier(self, stream: Optional[Stream] = None, *, tag: Optional[str] = None) -> Work:
        """Completes once every rank of the group has reached it."""

    @abc.abstractmethod
    def new_subgroup(self, ranks: Sequence[int]) -> Optional[ProcessGroup]:
        """Collective over this group: a group of the given global ranks (None on non-members)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release sockets / communicators / threads. Idempotent."""

    def lost_peers(self) -> list:
        """Global ranks of members whose connection is gone (they exited), as far as this group
        can tell without communicating; [] when it cannot tell."""
        return []

    def abort(self, reason: str) -> None:
        """Give up on the group now: peers blocked on this rank fail (with `reason` where the
        backend can say it) instead of waiting for their timeout. The group is unusable after."""
        self.shutdown()

    def poison(self, reason: str) -> None:
        """A collective failed on this rank (`reason` names the rank, the op and why): the ranks
        are out of step, so the group must not be used again. Every later collective of this
        rank raises naming `reason`, and the peers learn it (through the transport, or the store
        where there is none) and raise naming it too, instead of pairing later collectives one
        step apart. Nothing is paid per collective until then."""
        self.abort(reason)

    @contextlib.contextmanager
    def checking(self, what: str) -> Iterator[None]:
        """Around a collective's argument checks on this rank (`what`: "all_reduce"): refused on
        one rank of several, the call never reaches the transport while the peers' calls do, so
        the group is poisoned rather than left to pair this rank's next collective with their
        current one. A group of one keeps working: there is no peer to drift from; so does one
        whose ranks all found the same mismatch together (NCCL_DDP_DEBUG=DETAIL's check)."""
        try:
            yield
        except RankMismatchError:
            raise
        except NcclDdpError as e:
            if self.size > 1 and not self.failed:
                self.poison(
                    f"rank {self.ranks[self.rank]}: {what} on group {self.name!r} was refused on "
                    f"this rank, so the other ranks ran it without this one ({type(e).__name__}: {e})"
                )
            raise

    @property
    def failed(self) -> bool:
        """True once a collective of this group failed or the group was aborted: it is unusable
        and its peers may be gone (destroy_process_group then does not wait for them)."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank {self.rank}/{self.size}>"


def check_gather_buffers(where: str, size: int, big: Any, small: Any, big_name: str, small_name: str) -> None:
    """all_gather / reduce_scatter: the `big` buffer holds `size` x the `small` one, same dtype."""
    if big.dtype != small.dtype:
        raise ConfigError(
            f"{where}: {big_name} is {big.dtype} but {small_name} is {small.dtype}; use one dtype for both"
        )
    if big.size != small.size * size:
        raise ConfigError(
            f"{where}: {big_name} must hold group size ({size}) x {small_name} "
            f"elements; got {big_name} {big.size}, {small_name} {small.size}"
        )


class NonMemberGroup:
    """What `new_group(ranks)` returns on a rank outside `ranks` (like torch's NON_GROUP_MEMBER).

    It is falsy (`if group:` tells members apart) and every use of it as a group raises
    `ConfigError` naming the rank and the members, instead of silently running on the world."""

    def __init__(self, ranks: Sequence[int], rank: int) -> None:
        self.ranks, self.rank = tuple(ranks), rank

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<NonMemberGroup {list(self.ranks)} seen from rank {self.rank}>"

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(
            f"rank {self.rank}: {what}: this rank is not a member of the group of ranks "
            f"{list(self.ranks)} (new_group gave it a NonMemberGroup); only members may use the "
            f"group: skip the call on other ranks (`if group:`)"
        )
