"""Seeing the overlap: NVTX ranges per bucket phase and a per-step timeline of comm vs. backward.

The reducer's side of it (everything is off by default and then costs one `if`):

    prof = Timeline(rank, timeline=None, nvtx=None)   # None: NCCL_DDP_TIMELINE=1 / NCCL_DDP_NVTX=1
    prof.submit(stream, "allreduce", bucket, nbytes, fn, *args)  # off: stream.submit(fn, *args)
    prof.mark("backward", "start", stream)            # compute side; stream None = host time now
    prof.mark("backward", "end", stream)
    with prof.enqueued(stream, "allgather", bucket, nbytes): group.all_gather(..., stream=stream)
    with prof.range("finalize"): ...                  # an NVTX range on the calling thread
    summary = prof.end_step()                         # StepSummary (and one log line), or None
    prof.write_chrome_trace("trace_rank0.json")       # one track per stream; opens in Perfetto
    prof.close()                                      # writes the trace when trace_dir is set

Switches: NCCL_DDP_NVTX=1 (NVTX ranges), NCCL_DDP_TIMELINE=1 (timing; one summary line per step on
the `nccl_ddp.profiling` logger, shown on stderr when logging is not configured), and
NCCL_DDP_TRACE_DIR=dir (timing too, and `dir/trace_rank<R>.json` written at close or at exit).

Timing: on host streams `time.perf_counter()` inside the task, on its worker thread; on CUDA streams
timing events recorded before/after the work on that stream and resolved only in `end_step()` (the
one host wait, at the step boundary, and only with the timeline on). CUDA times are mapped onto the
host clock through the first event recorded, so mark the backward span on the compute stream too.

Per step (computed in step_summary.py): comm time = length of the union of pack/allreduce/unpack
intervals; overlap = the part of it inside the backward interval(s); ratio = overlap / comm. ZeRO's
parameter all-gathers ("allgather", one span per bucket, queued by the previous step's optimizer)
are counted apart: their union, the part of it inside the "forward" span(s) (hidden behind the next
forward), and that share. A step runs from one `end_step` to the next, so it holds the previous
optimizer step's gathers and this forward. Phases and NVTX colours: see PHASES.
NVTX comes from the `nvtx` package if installed, else `cupy.cuda.nvtx`; neither is imported if off.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict
from typing import Any, Callable, ContextManager, Iterator, Optional

from nccl_ddp.device import HostStream, ImmediateStream, Stream
from nccl_ddp.errors import ConfigError, NcclDdpError
from nccl_ddp.job.env import DEFAULT_TIMEOUT
from nccl_ddp.profiling.step_summary import Span, StepSummary, summarize

log = logging.getLogger("nccl_ddp.profiling")  # the package's name: what users configure

PHASES = {  # phase -> NVTX colour (ARGB)
    "forward": 0xFF64B5CD,
    "backward": 0xFF4C72B0,
    "pack": 0xFFDD8452,
    "allreduce": 0xFF55A868,
    "reducescatter": 0xFF55A868,
    "allgather": 0xFFCCB974,
    "unpack": 0xFFC44E52,
    "finalize": 0xFF8172B3,
}
OTHER_COLOUR = 0xFF999999
MAX_SPANS = 200_000  # spans kept for the Chrome trace (the oldest are dropped)
MAX_STEPS = 10_000  # step summaries kept in `Timeline.steps`
SYNC_TIMEOUT = DEFAULT_TIMEOUT  # seconds end_step waits for a step's work to finish


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _show_summaries() -> None:
    """The user switched the timeline on by environment: make its INFO lines visible on stderr
    unless logging is configured (Python shows only warnings by default)."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


# ---------------------------------------------------------------------------------- NVTX


class _Nvtx:
    """Push/pop of coloured NVTX ranges from the `nvtx` package or CuPy (loaded on first use)."""

    def __init__(self) -> None:
        try:
            import nvtx

            self.push: Callable[[str, int], Any] = lambda msg, c: nvtx.push_range(msg, color=c)
            self.pop: Callable[[], Any] = nvtx.pop_range
        except ImportError:
            from cupy.cuda import nvtx as cnvtx  # RangePushC(message, ARGB colour)

            self.push, self.pop = cnvtx.RangePushC, cnvtx.RangePop

    @contextlib.contextmanager
    def range(self, message: str, phase: str) -> Iterator[None]:
        self.push(message, PHASES.get(phase, OTHER_COLOUR))
        try:
            yield
        finally:
            self.pop()


def _label(phase: str, bucket: Optional[int], nbytes: int, dtype: str = "") -> str:
    if bucket is None:
        return phase
    return f"{phase} bucket {bucket} {nbytes / 2**20:.2f} MiB" + (f" {dtype}" if dtype else "")


# ---------------------------------------------------------------------------------- timeline


class _Stamp:
    """A host time filled in later, by whichever thread runs the work."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: Optional[float] = None

    def set(self) -> None:
        self.t = time.perf_counter()


class _CudaClock:
    """Timing events on raw CUDA streams, mapped onto the host clock via the first one recorded."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self._ref: Any = None
        self._ref_host = 0.0

    def event(self, stream: Any) -> Any:
        ev = self._cp.cuda.Event()
        self._cp.cuda.runtime.eventRecord(ev.ptr, int(stream.ptr))
        if self._ref is None:
            self._ref, self._ref_host = ev, time.perf_counter()
        return ev

    def host_time(self, ev: Any) -> float:
        ev.synchronize()
        return self._ref_host + self._cp.cuda.get_elapsed_time(self._ref, ev) / 1e3


def _is_host(stream: Stream) -> bool:
    return isinstance(stream, (HostStream, ImmediateStream))


class Timeline:
    """NVTX ranges and/or per-step timing of the reducer's stream work. See the module docstring."""

    def __init__(
        self,
        rank: int = 0,
        *,
        timeline: Optional[bool] = None,
        nvtx: Optional[bool] = None,
        trace_dir: Optional[str] = None,
    ) -> None:
        self.rank = rank
        from_env = timeline is None
        self.trace_dir = os.environ.get("NCCL_DDP_TRACE_DIR") or None if from_env else trace_dir
        self.timeline = (
            _env_on("NCCL_DDP_TIMELINE") or self.trace_dir is not None if from_env else bool(timeline)
        )
        if from_env and self.timeline:
            _show_summaries()
        use_nvtx = _env_on("NCCL_DDP_NVTX") if nvtx is None else bool(nvtx)
        self._nvtx: Optional[_Nvtx] = None
        if use_nvtx:
            try:
                self._nvtx = _Nvtx()
            except ImportError as e:
                log.warning(
                    "NVTX ranges requested but neither the nvtx package nor CuPy is "
                    "importable (%s); pip install nvtx",
                    e,
                )
        self._on = self.timeline or self._nvtx is not None
        self._clock: Optional[_CudaClock] = None
        self._tracks: dict = {}  # id(stream) -> (stream, track name)
        self._pending: list = []  # (track, phase, bucket, nbytes, start, end, dtype) this step
        self._open: dict = {}  # phase -> start point of an open mark
        self._host_streams: dict = {}  # id -> host stream used this step
        self._spans: collections.deque = collections.deque(maxlen=MAX_SPANS)
        self.steps: collections.deque = collections.deque(maxlen=MAX_STEPS)  # StepSummary
        self._step = 0
        self._written = False
        if self.trace_dir is not None:
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        return self._on

    def _track(self, stream: Stream) -> str:
        entry = self._tracks.get(id(stream))
        if entry is None:
            n = sum(1 for _, name in self._tracks.values() if name.startswith("comm"))
            entry = self._tracks[id(stream)] = (stream, "comm" if n == 0 else f"comm {n + 1}")
        return entry[1]

    def range(self, phase: str, bucket: Optional[int] = None, nbytes: int = 0) -> ContextManager[None]:
        """An NVTX range on the calling thread (a no-op context when NVTX is off)."""
        if self._nvtx is None:
            return contextlib.nullcontext()
        return self._nvtx.range(_label(phase, bucket, nbytes), phase)

    def submit(
        self,
        stream: Stream,
        phase: str,
        bucket: Optional[int],
        nbytes: int,
        fn: Callable[..., Any],
        *args: Any,
        dtype: str = "",
    ) -> None:
        """`stream.submit(fn, *args)`, wrapped in an NVTX range and timed when those are on.
        `dtype`: the wire dtype when it differs from the bucket's (compression hooks)."""
        if not self._on:
            stream.submit(fn, *args)
            return
        label = _label(phase, bucket, nbytes)
        if _is_host(stream):
            start, end = (_Stamp(), _Stamp()) if self.timeline else (None, None)
            stream.submit(self._host_task, label, phase, start, end, fn, args)
            if self.timeline:
                self._host_streams[id(stream)] = stream
        else:
            with self.range(phase, bucket, nbytes):
                start = self._cuda_event(stream)
                stream.submit(fn, *args)
                end = self._cuda_event(stream)
        if self.timeline:
            self._pending.append((self._track(stream), phase, bucket, nbytes, start, end, dtype))

    def _host_task(
        self,
        label: str,
        phase: str,
        start: Optional[_Stamp],
        end: Optional[_Stamp],
        fn: Callable[..., Any],
        args: tuple,
    ) -> None:
        with self._nvtx.range(label, phase) if self._nvtx else contextlib.nullcontext():
            if start is not None:
                start.set()
            try:
                fn(*args)
            finally:
                if end is not None:
                    end.set()

    def _cuda_event(self, stream: Stream) -> Any:
        if not self.timeline:
            return None
        if self._clock is None:
            self._clock = _CudaClock()
        return self._clock.event(stream)

    def mark(self, phase: str, edge: str, stream: Optional[Stream] = None) -> None:
        """Open (`edge="start"`) or close (`"end"`) a compute-side span such as "backward", at the
        current host time (stream None) or at this point of `stream`'s work."""
        if not self._on:
            return
        if edge not in ("start", "end"):
            raise ConfigError(f"mark edge must be 'start' or 'end', not {edge!r}")
        if self._nvtx is not None:
            if edge == "start":
                self._nvtx.push(phase, PHASES.get(phase, OTHER_COLOUR))
            else:
                self._nvtx.pop()
        if not self.timeline:
            return
        point = self._point(stream)
        if edge == "start":
            self._open[phase] = point
        elif phase in self._open:
            self._pending.append(("compute", phase, None, 0, self._open.pop(phase), point, ""))
        else:
            log.warning("profiling: mark(%r, 'end') without a start; ignored", phase)

    @contextlib.contextmanager
    def enqueued(self, stream: Stream, phase: str, bucket: Optional[int], nbytes: int) -> Iterator[None]:
        """Time the work the block itself enqueues on `stream` (a collective given `stream=`,
        which must be issued from this thread, in program order, not as a submitted task):
        points on `stream` before and after it. NVTX: a range around the enqueueing."""
        if not self._on:
            yield
            return
        with self.range(phase, bucket, nbytes):
            start = self._point(stream) if self.timeline else None
            yield
            end = self._point(stream) if self.timeline else None
        if self.timeline:
            self._pending.append((self._track(stream), phase, bucket, nbytes, start, end, ""))

    def _point(self, stream: Optional[Stream]) -> Any:
        """This instant (stream None) or this point of `stream`'s work, resolved in end_step."""
        if stream is None:
            return time.perf_counter()
        if _is_host(stream):
            point = _Stamp()
            stream.submit(point.set)
            self._host_streams[id(stream)] = stream
            return point
        return self._cuda_event(stream)

    def _time(self, point: Any) -> Optional[float]:
        if point is None or isinstance(point, float):
            return point
        if isinstance(point, _Stamp):
            return point.t
        if self._clock is None:
            return None
        return self._clock.host_time(point)

    def end_step(self) -> Optional[StepSummary]:
        """Resolve this step's times (waits for its work: the one host wait, timeline mode only),
        log one summary line and return it; None when the timeline is off."""
        if not self.timeline:
            return None
        for stream in self._host_streams.values():
            try:
                stream.record().synchronize(SYNC_TIMEOUT)
            except NcclDdpError as e:
                log.warning(
                    "profiling: step %d: a stream task failed (%s); its spans are dropped", self._step, e
                )
        spans = []
        for track, phase, bucket, nbytes, start, end, dtype in self._pending:
            t0, t1 = self._time(start), self._time(end)
            if t0 is not None and t1 is not None:
                spans.append(Span(self._step, track, phase, bucket, nbytes, t0, t1, dtype))
        summary = summarize(self.rank, self._step, spans)
        self._spans.extend(spans)
        self.steps.append(summary)
        self._pending, self._host_streams = [], {}
        self._step += 1
        log.info("%s", summary.line())
        return summary

    @property
    def spans(self) -> list:
        return list(self._spans)

    def close(self) -> None:
        """Write `trace_dir/trace_rank<R>.json` once, when a trace directory was asked for."""
        if self.trace_dir is None or self._written:
            return
        self._written = True
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"trace_rank{self.rank}.json")
        self.write_chrome_trace(path)
        log.info("rank %d: wrote the timeline of %d steps to %s", self.rank, len(self.steps), path)

    def write_chrome_trace(self, path: str) -> None:
        """Chrome-trace JSON of every span so far: pid = rank, one tid per track (compute, comm)."""
        spans = list(self._spans)
        origin = min((s.start for s in spans), default=0.0)
        tids = {"compute": 0}
        for s in spans:
            tids.setdefault(s.track, len(tids))
        events: list = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.rank,
                "tid": 0,
                "args": {"name": f"rank {self.rank}"},
            }
        ]
        events += [
            {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": track}}
            for track, tid in tids.items()
        ]
        for s in spans:
            args = {"step": s.step, "bucket": s.bucket, "bytes": s.nbytes}
            if s.dtype:
                args["wire_dtype"] = s.dtype
            events.append(
                {
                    "ph": "X",
                    "name": _label(s.phase, s.bucket, s.nbytes, s.dtype),
                    "cat": s.phase,
                    "pid": self.rank,
                    "tid": tids[s.track],
                    "ts": (s.start - origin) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": args,
                }
            )
        with open(path, "w") as f:
            json.dump(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ms",
                    "otherData": {"rank": self.rank, "steps": [asdict(st) for st in self.steps]},
                },
                f,
            )
