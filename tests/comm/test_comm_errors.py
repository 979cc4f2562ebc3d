"""A failing rank during a step: the survivors' error is a `CommError` that names the op, the
bucket, the group and the ranks, raised in the training thread within the group timeout."""

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from mp import run_ranks

from nccl_ddp.buckets.layout import bucket_tag
from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.device import HostDevice, HostStream
from nccl_ddp.errors import CommError, CommTimeout, ConfigError, ConfigTypeError, NcclDdpError

N = 1 << 16  # float32 elements per parameter: 256 KiB
TIMEOUT = 15.0  # group timeout of the multi-process tests
NAMES = ("w0", "w1", "w2", "w3")


def _caught(rank, t0, e):
    """Hand the error to the test through run_ranks' failure traceback."""
    raise RuntimeError(f"rank {rank} got {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}") from e


def _survivor_error(failed, rank=0):
    assert "exited with code 3" in failed[1], failed[1]
    m = re.search(rf"rank {rank} got (\w+) after ([\d.]+)s: (.*)", failed[rank])
    assert m, failed[rank]
    assert float(m.group(2)) < TIMEOUT / 2, failed[rank]  # the peer's death, not a timeout
    return m.group(1), m.group(3)


# ----------------------------------------------------------------------------- DDP step


def _ddp_peer_dies(rank, world, mode):
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=TIMEOUT)
    model = ArrayModule({k: np.zeros(N, np.float32) for k in NAMES}, forward=lambda p, x: x)
    ddp = nd.DistributedDataParallel(model, bucket_cap_mb=0.25, reducer_mode=mode)
    for step in range(2):
        ddp(step)
        if step == 1 and rank == 1:
            os._exit(3)  # dies after forward, before backward
        t0 = time.monotonic()
        try:
            for k in reversed(NAMES):
                ddp.mark_ready(k, np.ones(N, np.float32))
        except CommError as e:
            _caught(rank, t0, e)
        ddp.zero_grad()
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["CppReducer", "PythonReducer"])
def test_ddp_step_names_bucket_op_and_dead_peer(mode):
    failed = run_ranks(_ddp_peer_dies, 2, mode, timeout=60, expect_fail=True)
    assert set(failed) == {0, 1}, failed
    kind, msg = _survivor_error(failed)
    assert kind == "CommError", msg
    grad = r"grad \d \('w\d'\) of " if mode == "PythonReducer" else ""
    assert re.search(
        rf"all_reduce #\d+ of {grad}bucket \d \(256\.0 KiB\) on group 'world' "
        r"\(rank 0, group rank 0/2\) failed: ",
        msg,
    ), msg
    assert "peer rank 1" in msg, msg


def _ddp_after_failed_step(rank, world, mode, unused, out_path):
    """Rank 1 dies mid-step; rank 0 gets the CommError, then tries to go on: every step call must
    say that the previous step failed (the CommError as cause), at once, and close() must end."""
    import json

    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    nd.init_process_group("host", timeout=TIMEOUT)
    model = ArrayModule({k: np.zeros(N, np.float32) for k in NAMES}, forward=lambda p, x: x)
    ddp = nd.DistributedDataParallel(
        model, bucket_cap_mb=0.25, reducer_mode=mode, find_unused_parameters=unused
    )
    ddp(0)
    if rank == 1:
        os._exit(3)  # dies after forward, before backward
    try:
        for k in reversed(NAMES[1:] if unused else NAMES):
            ddp.mark_ready(k, np.ones(N, np.float32))
        if unused:
            ddp.finalize()
    except CommError as e:
        first = e
    else:
        raise AssertionError("rank 0 finished the step without its peer")
    later = {}
    for name, call in (
        ("forward", lambda: ddp(1)),
        ("mark_ready", lambda: ddp.mark_ready("w0", np.ones(N, np.float32))),
        ("finalize", ddp.finalize),
        ("zero_grad", ddp.zero_grad),
    ):
        t0 = time.monotonic()
        try:
            call()
            later[name] = ("no error", "", False, 0.0)
        except Exception as e:
            later[name] = (type(e).__name__, str(e), e.__cause__ is first, time.monotonic() - t0)
    t0 = time.monotonic()
    ddp.close()  # no error again, no wait on the dead peer
    with open(out_path, "w") as f:
        json.dump({"first": str(first), "later": later, "close_s": time.monotonic() - t0}, f)
    nd.destroy_process_group()  # skips its barrier: the world group failed


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,unused", [("CppReducer", False), ("PythonReducer", False), ("CppReducer", True)]
)
def test_ddp_after_a_failed_step_says_so(tmp_path, mode, unused):
    import json

    out = tmp_path / "rank0.json"
    failed = run_ranks(_ddp_after_failed_step, 2, mode, unused, str(out), timeout=60, expect_fail=True)
    assert "exited with code 3" in failed[1], failed
    assert out.exists(), failed
    got = json.loads(out.read_text())
    assert "peer rank 1" in got["first"], got
    for name, (kind, msg, caused, seconds) in got["later"].items():
        assert kind == "ReducerError", (name, kind, msg)
        assert msg.startswith("rank 0: a previous step failed (CommError: "), (name, msg)
        assert got["first"] in msg and "process group is unusable" in msg, (name, msg)
        assert "Restart the job" in msg and "prior iteration" not in msg, (name, msg)
        assert caused, (name, "the CommError is not the cause")
        assert seconds < 1.0, (name, seconds)
    assert set(got["later"]) == {"forward", "mark_ready", "finalize", "zero_grad"}
    assert got["close_s"] < 1.0, got


def test_ddp_after_its_group_was_shut_down_says_so():
    from nccl_ddp import DistributedDataParallel
    from nccl_ddp.adapters.arrays import ArrayModule
    from nccl_ddp.errors import ReducerError

    g = HostProcessGroup(None, 0, 1)
    model = ArrayModule({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}, forward=lambda p, x: x)
    ddp = DistributedDataParallel(model, process_group=g)
    g.shutdown()
    ddp(0)
    ddp.mark_ready("a", np.ones(4, np.float32))
    with pytest.raises(CommError, match="called after the group was shut down") as first:
        ddp.mark_ready("b", np.ones(4, np.float32))
    for call in (lambda: ddp(1), lambda: ddp.mark_ready("a"), ddp.zero_grad):
        with pytest.raises(
            ReducerError,
            match="rank 0: a previous step failed .CommError: .*shut down.*process group is unusable",
        ) as later:
            call()
        assert later.value.__cause__ is first.value
    ddp.close()


# ----------------------------------------------------------------------------- grad reducer


def _grad_reducer_peer_dies(rank, world):
    import nccl_ddp as nd

    nd.init_process_group("host", timeout=TIMEOUT)
    red = nd.DistributedGradReducer([np.zeros(N, np.float32) for _ in range(3)])
    grads = [np.full(N, rank + 1.0, np.float32) for _ in range(3)]
    out = red(grads)
    np.testing.assert_allclose(out[0], 1.5)
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        red(grads)
    except CommError as e:
        _caught(rank, t0, e)
    return "no error"


@pytest.mark.slow
def test_grad_reducer_names_bucket_op_and_dead_peer():
    failed = run_ranks(_grad_reducer_peer_dies, 2, timeout=60, expect_fail=True)
    assert set(failed) == {0, 1}, failed
    kind, msg = _survivor_error(failed)
    assert kind == "CommError", msg
    assert re.search(
        r"all_reduce #\d+ of bucket 0 \(768\.0 KiB\) on group 'world' \(rank 0, "
        r"group rank 0/2\) failed: .*peer rank 1",
        msg,
    ), msg


def _grad_reducer_after_failed_call(rank, world, out_path):
    """Rank 1 dies between two calls; rank 0's second call raises the CommError, every later one
    says that a previous step failed (the CommError as cause), at once; close() ends at once."""
    import json

    import nccl_ddp as nd

    nd.init_process_group("host", timeout=TIMEOUT)
    red = nd.DistributedGradReducer([np.zeros(N, np.float32) for _ in range(3)])
    grads = [np.full(N, rank + 1.0, np.float32) for _ in range(3)]
    red(grads)
    if rank == 1:
        os._exit(3)
    try:
        red(grads)
    except CommError as e:
        first = e
    else:
        raise AssertionError("rank 0 reduced without its peer")
    later = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            red(grads)
            later.append(("no error", "", False, 0.0))
        except Exception as e:
            later.append((type(e).__name__, str(e), e.__cause__ is first, time.monotonic() - t0))
    t0 = time.monotonic()
    red.close()
    with open(out_path, "w") as f:
        json.dump({"first": str(first), "later": later, "close_s": time.monotonic() - t0}, f)


@pytest.mark.slow
def test_grad_reducer_after_a_failed_call_says_so(tmp_path):
    import json

    out = tmp_path / "rank0.json"
    failed = run_ranks(_grad_reducer_after_failed_call, 2, str(out), timeout=60, expect_fail=True)
    assert "exited with code 3" in failed[1], failed
    assert out.exists(), failed
    got = json.loads(out.read_text())
    assert re.search(
        r"all_reduce #\d+ of bucket 0 \(768\.0 KiB\) on group 'world'.*peer rank 1", got["first"]
    ), got
    assert len(got["later"]) == 2, got
    for kind, msg, caused, seconds in got["later"]:
        assert kind == "ReducerError", (kind, msg)
        assert msg.startswith("rank 0: a previous step failed (CommError: "), msg
        assert got["first"] in msg and "process group is unusable" in msg, msg
        assert msg.endswith("a new DistributedGradReducer)"), msg
        assert caused, "the CommError is not the cause"
        assert seconds < 1.0, seconds
    assert got["close_s"] < 1.0, got


# ----------------------------------------------------------------------------- the launcher


# Rank 1 exits 1 in step 2. Rank 0 ignores SIGTERM so that it outlives the launcher's stop
# request long enough to print what it caught; the launcher's SIGKILL (grace 1 s) ends it.
TRAIN = """
    import signal, sys, time
    import numpy as np
    import nccl_ddp as nd
    from nccl_ddp.adapters.arrays import ArrayModule

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    nd.init_process_group("host", timeout=20.0)
    rank = nd.get_rank()
    names = ["w0", "w1", "w2", "w3"]
    model = ArrayModule({k: np.zeros(1 << 16, np.float32) for k in names}, forward=lambda p, x: x)
    ddp = nd.DistributedDataParallel(model, bucket_cap_mb=0.25)
    for step in range(5):
        ddp(step)
        if rank == 1 and step == 2:
            sys.exit(1)
        try:
            for k in reversed(names):
                ddp.mark_ready(k, np.ones(1 << 16, np.float32))
        except nd.errors.CommError as e:
            print(f"caught {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            time.sleep(60)
        ddp.zero_grad()
        print(f"step {step} done", flush=True)
"""


@pytest.mark.slow
def test_launcher_exits_naming_the_rank_that_died(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "NCCL_DDP_SECRET", "RANK", "WORLD_SIZE")
    }
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nccl_ddp.launch",
            "--nproc-per-node",
            "2",
            "--grace-period",
            "1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "root cause: rank 1 (local rank 1): exit code 1" in r.stderr, r.stderr
    assert "[rank 1] step 1 done" in r.stdout and "step 2 done" not in r.stdout, r.stdout
    caught = [line for line in r.stderr.splitlines() if line.startswith("[rank 0] caught ")]
    assert caught and "CommError" in caught[0] and "bucket" in caught[0], r.stderr
    assert "all_reduce" in caught[0] and "peer rank 1" in caught[0], caught
    assert elapsed < 30, (elapsed, r.stderr)


# ----------------------------------------------------------------------------- in one process


def test_host_messages_carry_the_tag():
    g = HostProcessGroup(None, 0, 1)
    stream = HostStream("blocked")
    try:
        with pytest.raises(
            ConfigTypeError,
            match=r"all_reduce of bucket 2 \(4 B\) on group 'world' "
            r"\(rank 0, group rank 0/1\).*complex64",
        ):
            g.all_reduce(np.zeros(1, np.complex64), tag="bucket 2 (4 B)")
        with pytest.raises(ConfigError, match="all_gather of grad 5 on group 'world'.*group size"):
            g.all_gather(np.empty(5, np.int32), np.zeros(3, np.int32), tag="grad 5")
        stream.submit(time.sleep, 1.0)
        w = g.barrier(stream=stream, tag="bucket 9 (1 B)")
        with pytest.raises(CommTimeout, match=r"barrier #1 of bucket 9 \(1 B\) on group 'world'"):
            w.wait(0.1)
        assert w.wait(10)
        x = np.ones(3, np.float32)
        g.all_reduce(x, tag="bucket 0").wait()  # a tag changes nothing else
        np.testing.assert_array_equal(x, 1)
    finally:
        stream.close()
        g.shutdown()


def test_host_stream_reraises_our_errors_as_they_are():
    stream = HostStream("comm")
    err = CommError("all_reduce #3 of bucket 1 (1.0 MiB) on group 'world' (rank 0) failed")
    try:
        stream.submit(lambda: (_ for _ in ()).throw(err))
        ev = stream.record()
        with pytest.raises(CommError) as e:
            ev.synchronize(10)
        assert e.value is err
        with pytest.raises(CommError) as e:  # the next submit raises it too
            stream.submit(lambda: None)
        assert e.value is err
    finally:
        stream.close()
    other = HostStream("other")
    try:
        other.submit(lambda: 1 / 0)
        with pytest.raises(NcclDdpError, match="host stream task failed: division by zero") as e:
            other.synchronize(10)
        assert isinstance(e.value.__cause__, ZeroDivisionError)
    finally:
        other.close()


def test_host_event_is_reached_once_and_times_out():
    from nccl_ddp.device import HostEvent

    ev = HostEvent()
    assert not ev.query() and not ev.reached(0.01)
    with pytest.raises(CommTimeout, match="not reached within 0.0s"):
        ev.synchronize(0.01)
    err = CommError("all_reduce #1 failed")
    threading.Timer(0.05, ev._set, (err,)).start()
    assert ev.reached(10) and ev.query()
    with pytest.raises(CommError) as e:
        ev.synchronize(10)
    assert e.value is err
    ev._set(None)  # a second set changes nothing (the first error stays)
    assert ev.error is err and ev.reached(0) and ev.reached(0)  # any number of waiters
    done = HostDevice().current_stream().record()  # the immediate stream's shared event
    assert done.query() and done.error is None
    done.synchronize(0)


def test_awaited_host_stream_runs_inline_only_when_idle():
    stream = HostStream("comm")
    me = threading.current_thread().name
    ran = []
    try:
        stream.submit(lambda: ran.append(("queued", threading.current_thread().name)))
        stream.synchronize(10)
        with stream.awaited():
            stream.submit(lambda: ran.append(("idle", threading.current_thread().name)))
            assert stream.record().query()  # nothing queued: reached at once
            gate = threading.Event()
            stream.submit(lambda: ran.append(("inline", threading.current_thread().name)))
            stream.wait(_event_set_by(gate))  # a wait queues: busy from here on
            stream.submit(lambda: ran.append(("after the wait", threading.current_thread().name)))
            ev = stream.record()
            assert not ev.query()
            gate.set()
            ev.synchronize(10)
        assert ran == [("queued", "comm"), ("idle", me), ("inline", me), ("after the wait", "comm")], ran
        with stream.awaited(), pytest.raises(ZeroDivisionError):
            stream.submit(lambda: 1 / 0)  # inline: raised here ...
        with pytest.raises(NcclDdpError, match="division by zero"):
            stream.submit(lambda: None)  # ... and kept, as from the worker
    finally:
        stream.close()


def _event_set_by(gate):
    """A HostEvent reached when `gate` is set."""
    from nccl_ddp.device import HostEvent

    ev = HostEvent()
    threading.Thread(target=lambda: (gate.wait(10), ev._set()), daemon=True).start()
    return ev


@pytest.mark.parametrize(
    "b,nbytes,want",
    [
        (3, 1 << 20, "bucket 3 (1.0 MiB)"),
        (0, 40, "bucket 0 (40 B)"),
        (1, 1536, "bucket 1 (1.5 KiB)"),
        (2, 25 * (1 << 20) + 1, "bucket 2 (25.0 MiB)"),
    ],
)
def test_bucket_tag(b, nbytes, want):
    assert bucket_tag(b, nbytes) == want
