"""nccl_ddp.profiling (timeline, step_summary): interval math, the host-stream timeline, Chrome
trace, NVTX hooks, off = free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest

from nccl_ddp import profiling as pf
from nccl_ddp.device import HostStream
from nccl_ddp.profiling import step_summary as ss

MiB = 1 << 20


# ---------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "intervals,length",
    [
        ([], 0.0),
        ([(0, 1), (2, 3)], 2.0),  # disjoint
        ([(0, 1), (1, 3)], 3.0),  # adjacent
        ([(0, 10), (2, 3), (4, 5)], 10.0),  # nested
        ([(0, 4), (2, 6), (5, 7)], 7.0),  # chained overlaps
        ([(5, 7), (0, 4), (2, 6)], 7.0),  # unsorted
        ([(3, 3), (4, 2)], 0.0),  # empty / reversed ignored
    ],
)
def test_union_length(intervals, length):
    assert ss.union_length(intervals) == length


@pytest.mark.parametrize(
    "a,b,overlap",
    [
        ([(0, 4)], [(2, 6)], 2.0),
        ([(0, 1), (1, 2)], [(0.5, 1.5)], 1.0),  # adjacent a counted once
        ([(0, 10)], [(1, 2), (3, 4)], 2.0),  # nested b
        ([(0, 1)], [(1, 2)], 0.0),  # touching only
        ([(0, 1), (5, 6)], [(2, 3)], 0.0),  # disjoint
        ([(0, 3), (1, 2)], [(0, 3), (2, 5)], 3.0),  # overlaps inside both sides counted once
    ],
)
def test_overlap_length(a, b, overlap):
    assert ss.overlap_length(a, b) == overlap
    assert ss.overlap_length(b, a) == overlap


def test_summarize_synthetic_step():
    S = ss.Span
    spans = [
        S(0, "compute", "backward", None, 0, 10.0, 20.0),
        S(0, "comm", "pack", 0, 4 * MiB, 12.0, 13.0),
        S(0, "comm", "allreduce", 0, 4 * MiB, 13.0, 18.0),
        S(0, "comm", "unpack", 0, 4 * MiB, 18.0, 19.0),
        S(0, "comm", "allreduce", 1, 2 * MiB, 19.0, 25.0),  # 1 s inside, 5 s after
        S(0, "compute", "finalize", None, 0, 25.0, 26.0),
    ]
    s = ss.summarize(3, 0, spans)
    assert (s.rank, s.comm_s, s.overlap_s, s.backward_s, s.step_s) == (3, 13.0, 8.0, 10.0, 16.0)
    assert s.overlap_ratio == 8.0 / 13.0
    assert (s.buckets, s.nbytes) == (2, 6 * MiB)
    assert "rank 3 step 0: comm 13000.000 ms" in s.line() and "(62%)" in s.line()
    assert ss.summarize(0, 1, []).overlap_ratio == 0.0


def test_summarize_param_gather_hidden_behind_forward():
    """ZeRO's parameter all-gathers are counted apart from the bucket reductions: their union,
    and the part inside forward (the share hidden behind it)."""
    S = ss.Span
    spans = [
        S(0, "comm", "allgather", 0, MiB, 0.0, 2.0),  # before forward
        S(0, "comm", "allgather", 1, MiB, 2.0, 5.0),  # 2 s inside forward
        S(0, "compute", "forward", None, 0, 3.0, 6.0),
        S(0, "compute", "backward", None, 0, 6.0, 9.0),
        S(0, "comm", "reducescatter", 0, MiB, 7.0, 8.0),
    ]
    s = ss.summarize(0, 0, spans)
    assert (s.gather_s, s.gather_hidden_s, s.forward_s) == (5.0, 2.0, 3.0)
    assert s.gather_hidden_ratio == 2.0 / 5.0
    assert (s.comm_s, s.overlap_s, s.buckets) == (1.0, 1.0, 1)  # the gathers are not bucket comm
    assert "param all-gather 5000.000 ms, hidden behind forward 2000.000 ms (40%)" in s.line()
    no_forward = ss.summarize(0, 0, [sp for sp in spans if sp.phase != "forward"])
    assert (no_forward.gather_s, no_forward.gather_hidden_ratio) == (5.0, 0.0)
    assert "all-gather" not in ss.summarize(0, 0, spans[3:]).line()


# ---------------------------------------------------------------------------------- host timeline


def _backward_with_comm(prof, comm, inside: bool):
    """One step: three comm phases either fully inside the backward span or after it."""
    go, finished = threading.Event(), threading.Event()

    def work(seconds, last=False):
        assert go.wait(10)
        time.sleep(seconds)
        if last:
            finished.set()

    def submit_all():
        prof.submit(comm, "pack", 2, MiB, work, 0.01)
        prof.submit(comm, "allreduce", 2, MiB, work, 0.02)
        prof.submit(comm, "unpack", 2, MiB, work, 0.01, True)

    prof.mark("backward", "start")
    if inside:
        submit_all()
        go.set()
        assert finished.wait(10)
        comm.synchronize(10)
        prof.mark("backward", "end")
    else:
        time.sleep(0.01)
        prof.mark("backward", "end")
        submit_all()
        go.set()
    return prof.end_step()


def test_host_timeline_overlap_and_chrome_trace(tmp_path):
    prof = pf.Timeline(rank=1, timeline=True, nvtx=False)
    comm = HostStream("comm")
    try:
        inside = _backward_with_comm(prof, comm, inside=True)
        after = _backward_with_comm(prof, comm, inside=False)
    finally:
        comm.close()
    assert inside.step == 0 and after.step == 1
    assert inside.comm_s >= 0.04 and inside.overlap_s == inside.comm_s
    assert inside.overlap_ratio == 1.0
    assert after.comm_s >= 0.04 and after.overlap_s == 0.0 and after.overlap_ratio == 0.0
    assert inside.buckets == 1 and inside.nbytes == MiB
    step0 = [s for s in prof.spans if s.step == 0]
    order = [s.phase for s in sorted(step0, key=lambda s: s.start)]
    assert order == ["backward", "pack", "allreduce", "unpack"]
    pack, ar = step0[1], step0[2]
    assert pack.track == ar.track == "comm" and pack.end <= ar.start

    path = tmp_path / "trace_rank1.json"
    prof.write_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert set(names) == {"compute", "comm"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 8 and all(e["pid"] == 1 and e["dur"] >= 0 for e in spans)
    assert {e["tid"] for e in spans if e["cat"] == "backward"} == {names["compute"]}
    assert {e["tid"] for e in spans if e["cat"] == "allreduce"} == {names["comm"]}
    assert any(e["name"] == "allreduce bucket 2 1.00 MiB" for e in spans)
    assert min(e["ts"] for e in spans) == 0.0
    assert [s["overlap_ratio"] for s in trace["otherData"]["steps"]] == [1.0, 0.0]


def test_failed_host_task_does_not_break_end_step():
    prof = pf.Timeline(timeline=True, nvtx=False)
    comm = HostStream("comm")
    try:

        def boom():
            raise RuntimeError("task failed")

        prof.submit(comm, "allreduce", 0, 4, boom)
        prof.submit(comm, "unpack", 0, 4, lambda: None)  # skipped by the stream: dropped
        summary = prof.end_step()
    finally:
        comm.close()
    assert [s.phase for s in prof.spans] == ["allreduce"]
    assert summary.comm_s > 0


# ---------------------------------------------------------------------------------- off / NVTX


class RecordingStream:
    def __init__(self):
        self.calls = []

    def submit(self, fn, *args):
        self.calls.append((fn, args))


def test_off_is_plain_submit(monkeypatch):
    monkeypatch.delenv("NCCL_DDP_TIMELINE", raising=False)
    monkeypatch.delenv("NCCL_DDP_NVTX", raising=False)
    prof = pf.Timeline()
    assert not prof.enabled
    s = RecordingStream()
    fn = object()
    prof.submit(s, "allreduce", 0, 10, fn, 1, 2)
    assert s.calls == [(fn, (1, 2))]
    prof.mark("backward", "start")
    assert prof.end_step() is None and prof.spans == []
    with prof.range("finalize"):
        pass


def test_env_turns_timeline_on(monkeypatch):
    monkeypatch.setenv("NCCL_DDP_TIMELINE", "1")
    assert pf.Timeline(nvtx=False).timeline


def test_nothing_imports_cupy_when_nvtx_off():
    code = (
        "import sys\n"
        "from nccl_ddp.profiling import Timeline\n"
        "from nccl_ddp.device import HostStream\n"
        "for kw in ({}, {'timeline': True}):\n"
        "    p, s = Timeline(**kw), HostStream()\n"
        "    p.mark('backward', 'start'); p.submit(s, 'pack', 0, 8, lambda: None)\n"
        "    p.mark('backward', 'end'); p.end_step(); s.close()\n"
        "assert 'cupy' not in sys.modules and 'nvtx' not in sys.modules, 'imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_DDP_")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_nvtx_ranges_named_and_coloured(monkeypatch):
    log = []
    fake = types.ModuleType("nvtx")
    fake.push_range = lambda msg, color: log.append(("push", msg, color, threading.current_thread().name))
    fake.pop_range = lambda: log.append(("pop", threading.current_thread().name))
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    prof = pf.Timeline(nvtx=True, timeline=False)
    comm = HostStream("comm-worker")
    try:
        prof.mark("backward", "start")
        prof.submit(comm, "allreduce", 3, MiB, lambda: log.append(("work",)))
        comm.synchronize(10)
        prof.mark("backward", "end")
        with prof.range("finalize"):
            log.append(("finalize",))
    finally:
        comm.close()
    main = threading.current_thread().name
    assert log == [
        ("push", "backward", pf.PHASES["backward"], main),
        ("push", "allreduce bucket 3 1.00 MiB", pf.PHASES["allreduce"], "comm-worker"),
        ("work",),
        ("pop", "comm-worker"),
        ("pop", main),
        ("push", "finalize", pf.PHASES["finalize"], main),
        ("finalize",),
        ("pop", main),
    ]
    assert prof.end_step() is None


def test_nvtx_through_cupy_when_no_nvtx_package(monkeypatch):
    """The real cupy.cuda.nvtx calls (no-ops without a profiler) take our labels and colours."""
    pytest.importorskip("cupy")
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` raises ImportError
    prof = pf.Timeline(nvtx=True, timeline=True)
    comm = HostStream("comm")
    try:
        prof.mark("backward", "start")
        prof.submit(comm, "pack", 0, MiB, lambda: None)
        with prof.range("finalize"):
            pass
        prof.mark("backward", "end")
        assert prof.end_step().comm_s >= 0
    finally:
        comm.close()
    assert prof._nvtx.pop.__module__.startswith("cupy")


# ---------------------------------------------------------------------------------- CUDA timeline

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


@pytest.mark.gpu
def test_cuda_timeline_events_resolve_at_step_end(tmp_path):
    """A long kernel on the compute stream between the backward marks, a short one on the comm
    stream launched inside: CUDA timing events must place the comm span inside backward."""
    cp = pytest.importorskip("cupy")
    from nccl_ddp.device import CudaDevice

    dev = CudaDevice(0)
    compute, comm = dev.new_stream(), dev.new_stream()
    spin = cp.RawKernel(_SPIN, "spin")
    rate = cp.cuda.Device(0).attributes["ClockRate"] * 1000  # cycles per second
    prof = pf.Timeline(timeline=True, nvtx=False)
    prof.mark("backward", "start", compute)
    compute.submit(spin, (1,), (1,), (cp.int64(rate * 0.2),))
    prof.submit(comm, "allreduce", 0, MiB, spin, (1,), (1,), (cp.int64(rate * 0.02),))
    prof.mark("backward", "end", compute)
    s = prof.end_step()
    assert 0.005 < s.comm_s < s.backward_s
    assert s.overlap_ratio > 0.5 and s.buckets == 1
    prof.write_chrome_trace(str(tmp_path / "t.json"))
    tracks = {
        e["args"]["name"]
        for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
        if e.get("name") == "thread_name"
    }
    assert tracks == {"compute", "comm"}


def test_trace_dir_from_environment_writes_one_trace_per_rank(tmp_path, monkeypatch):
    """NCCL_DDP_TRACE_DIR switches timing on and close() writes trace_rank<R>.json (once)."""
    from nccl_ddp.device import HostStream

    monkeypatch.setenv("NCCL_DDP_TRACE_DIR", str(tmp_path / "tr"))
    monkeypatch.delenv("NCCL_DDP_TIMELINE", raising=False)
    prof = pf.Timeline(rank=3)
    assert prof.timeline and prof.trace_dir == str(tmp_path / "tr")
    s = HostStream()
    prof.mark("backward", "start")
    prof.submit(s, "allreduce", 0, 64, time.sleep, 0.01)
    prof.mark("backward", "end")
    prof.end_step()
    prof.close()
    prof.close()
    data = json.loads((tmp_path / "tr" / "trace_rank3.json").read_text())
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert any("allreduce" in n for n in names), names
    assert len(data["otherData"]["steps"]) == 1
    s.close()


def test_timeline_off_by_default_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_DDP_TRACE_DIR", raising=False)
    monkeypatch.delenv("NCCL_DDP_TIMELINE", raising=False)
    prof = pf.Timeline()
    assert not prof.timeline and prof.trace_dir is None
    prof.close()
