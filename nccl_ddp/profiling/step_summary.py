"""What a step's timeline says about overlap: the spans the profiler records (`Span`), the interval
arithmetic over them, and one step's numbers (`StepSummary`, `summarize`): how much of the bucket
communication ran inside backward, and how much of ZeRO's parameter all-gathers inside the next
forward. Pure computation on host times, so scripts (overlap_report.py) and tests use it alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

COMM_PHASES = frozenset({"pack", "allreduce", "reducescatter", "unpack", "hook"})
REDUCE_PHASES = frozenset({"allreduce", "reducescatter"})  # one per bucket (ZeRO-2: the latter)


def merge_intervals(intervals: Iterable[Sequence[float]]) -> list:
    """Sorted, disjoint (start, end) intervals covering the same points; empty ones dropped."""
    merged: list = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def union_length(intervals: Iterable[Sequence[float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    return sum(e - s for s, e in merge_intervals(intervals))


def overlap_length(a: Iterable[Sequence[float]], b: Iterable[Sequence[float]]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    a, b = merge_intervals(a), merge_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------------------- spans


@dataclass(frozen=True)
class Span:
    """One resolved interval, in seconds on the host clock."""

    step: int
    track: str
    phase: str
    bucket: Optional[int]
    nbytes: int
    start: float
    end: float
    dtype: str = ""  # the wire dtype when a hook compressed the bucket ("bfloat16")


@dataclass(frozen=True)
class StepSummary:
    """What one step's timeline says about overlap (seconds)."""

    rank: int
    step: int
    comm_s: float  # union of pack/allreduce/unpack intervals
    overlap_s: float  # the part of comm_s inside backward
    overlap_ratio: float  # overlap_s / comm_s (0 when there was no comm)
    backward_s: float
    step_s: float  # first to last recorded instant of the step
    buckets: int
    nbytes: int
    gather_s: float = 0.0  # union of the parameter all-gathers (ZeRO) in this step
    gather_hidden_s: float = 0.0  # the part of gather_s inside forward
    gather_hidden_ratio: float = 0.0  # gather_hidden_s / gather_s (0 when there was no gather)
    forward_s: float = 0.0

    def line(self) -> str:
        text = (
            f"rank {self.rank} step {self.step}: comm {self.comm_s * 1e3:.3f} ms, overlapped "
            f"with backward {self.overlap_s * 1e3:.3f} ms ({self.overlap_ratio:.0%}), "
            f"backward {self.backward_s * 1e3:.3f} ms, step {self.step_s * 1e3:.3f} ms, "
            f"{self.buckets} buckets {self.nbytes / 2**20:.2f} MiB"
        )
        if self.gather_s > 0:
            text += (
                f", param all-gather {self.gather_s * 1e3:.3f} ms, hidden behind forward "
                f"{self.gather_hidden_s * 1e3:.3f} ms ({self.gather_hidden_ratio:.0%})"
            )
        return text


def summarize(rank: int, step: int, spans: Sequence[Span]) -> StepSummary:
    """Overlap numbers of one step's spans."""
    comm = [(s.start, s.end) for s in spans if s.phase in COMM_PHASES]
    backward = [(s.start, s.end) for s in spans if s.phase == "backward"]
    comm_s = union_length(comm)
    overlap = overlap_length(comm, backward)
    ar = [s for s in spans if s.phase in REDUCE_PHASES]
    gather = [(s.start, s.end) for s in spans if s.phase == "allgather"]
    forward = [(s.start, s.end) for s in spans if s.phase == "forward"]
    gather_s = union_length(gather)
    gather_hidden = overlap_length(gather, forward)
    return StepSummary(
        rank=rank,
        step=step,
        comm_s=comm_s,
        overlap_s=overlap,
        overlap_ratio=overlap / comm_s if comm_s > 0 else 0.0,
        backward_s=union_length(backward),
        step_s=(max(s.end for s in spans) - min(s.start for s in spans)) if spans else 0.0,
        buckets=len({s.bucket for s in ar}),
        nbytes=sum(s.nbytes for s in ar),
        gather_s=gather_s,
        gather_hidden_s=gather_hidden,
        gather_hidden_ratio=gather_hidden / gather_s if gather_s > 0 else 0.0,
        forward_s=union_length(forward),
    )
