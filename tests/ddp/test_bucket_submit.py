"""Bucket submission (nccl_ddp/ddp/bucket_submit.py): what a registered comm hook makes of a
bucket (`HookPath`), and the collective as a choice the reducer's buckets all go through."""

import functools

import numpy as np
import pytest
from fakegroup import FakeGroup, _Shared, run_threads

from nccl_ddp import hooks
from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.buckets.layout import ParamSpec, assign_buckets
from nccl_ddp.comm.group import ReduceOp
from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.ddp.bucket_submit import AllReduce, BucketSubmitter, HookPath
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.device import get_device
from nccl_ddp.zero.reduce_scatter import GradPool


class _Group:
    rank, size = 0, 2


def _bucket(dtype):
    specs = [ParamSpec((4,), np.dtype(dtype))]
    return assign_buckets(specs).buckets[0]


def _hook(state, bucket):
    return hooks.Future.completed(bucket.buffer())


@pytest.mark.parametrize(
    "registered, dtype, want",
    [
        (None, np.float32, (HookPath.OWN, "")),
        ((None, hooks.allreduce), np.float32, (HookPath.OWN, "")),
        ((None, hooks.bf16_compress), np.float32, (HookPath.COMPRESSED, "bfloat16")),
        ((None, hooks.fp16_compress), np.float32, (HookPath.COMPRESSED, "float16")),
        ((None, hooks.fp16_compress), np.float16, (HookPath.OWN, "")),  # already in the wire dtype
        ((None, hooks.fp16_compress), np.float64, (HookPath.HOOK, "")),  # not fusable: the hook runs
        ((None, _hook), np.float32, (HookPath.HOOK, "")),
        (("group", hooks.allreduce), np.float32, (HookPath.OWN, "")),  # state: the DDP's group
        (("another group", hooks.allreduce), np.float32, (HookPath.HOOK, "")),
    ],
)
def test_hook_path_says_how_the_hook_runs(registered, dtype, want):
    group = _Group()
    sub = BucketSubmitter(
        group, get_device("host"), None, specs=[], params=[], average_in_collective=False, label=str
    )
    if registered is not None and registered[0] == "group":
        registered = (group, registered[1])
    sub.comm_hook = registered
    assert sub.hook_path(_bucket(dtype)) == want


class _Recording:
    """A collective that records what it reduces, then all-reduces it."""

    phase = "allreduce"

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, buf, op, tag):
        self.calls.append((buf.size, str(buf.dtype), tag))
        self.inner(buf, op, tag)


def _chosen_collective(group, hook, mode):
    params = {f"p{i}": np.zeros(n, np.float32) for i, n in enumerate((10, 7, 3))}
    model = ArrayModule(params)
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0, reducer_mode=mode)
    sub = ddp.reducer.submitter
    recording = _Recording(sub.collective)
    sub.collective = recording
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    for k in reversed(list(params)):
        ddp.mark_ready(k, np.full(params[k].shape, group.rank + 1.0, np.float32))
    return recording.calls, {k: np.array(v) for k, v in model.grads.items()}


@pytest.mark.parametrize(
    "hook, mode", [(None, "CppReducer"), (hooks.bf16_compress, "CppReducer"), (None, "PythonReducer")]
)
def test_every_bucket_goes_through_the_chosen_collective(hook, mode):
    for calls, grads in run_threads(_chosen_collective, 2, hook, mode):
        # bucket_cap_mb=0: one bucket per parameter, in reverse order, each reduced once
        assert [c[0] >= n for c, n in zip(calls, (3, 7, 10))] == [True] * 3, calls
        assert len(calls) == 3
        wire = "bfloat16" if hook is not None else "float32"
        assert {c[1] for c in calls} == {wire}
        assert [c[2].split(" of ")[-1].split(" (")[0] for c in calls] == ["bucket 0", "bucket 1", "bucket 2"]
        for g in grads.values():
            np.testing.assert_allclose(g, 1.5)  # mean of 1 and 2


def test_all_reduce_is_the_default_collective():
    sub = BucketSubmitter(
        _Group(), get_device("host"), None, specs=[], params=[], average_in_collective=False, label=str
    )
    assert isinstance(sub.collective, AllReduce) and sub.collective.phase == "allreduce"


# -- the steps each path queues on the comm stream ------------------------------------------------
# One bucket of two float32 grads (params 1 and 0, in that order; 6 and 10 elements, 80 bytes
# with the alignment) through every path; what `Timeline.submit` is handed is recorded: (phase,
# bucket, bytes, callable, args, wire dtype). Callables by name (a helper's without its privacy
# underscore, so a helper may move between modules), a partial's keywords with it; arrays as
# dtype[size]. The tables are the sequences the submitter queued before its paths became plans
# (44408c8); a change to a path's steps must change its row here.


class _Recorder:
    """A timeline that records what it is handed instead of queueing it."""

    def __init__(self):
        self.steps = []

    def submit(self, stream, phase, bucket, nbytes, fn, *args, dtype=""):
        self.steps.append((phase, bucket, nbytes, _name(fn), tuple(_describe(a) for a in args), dtype))


def _name(fn):
    if isinstance(fn, functools.partial):
        kw = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(fn.keywords.items()))
        return f"{_name(fn.func)}({kw})"
    name = getattr(fn, "__name__", None)
    return type(fn).__name__ if name is None else name.lstrip("_")


def _describe(a):
    if isinstance(a, np.ndarray):
        return f"{a.dtype}[{a.size}]"
    if isinstance(a, (list, tuple)):
        return [_describe(x) for x in a]
    if isinstance(a, ReduceOp):
        return a.value
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return _name(a) if callable(a) else type(a).__name__


class _Pooled:
    """A collective with a GradPool (ZeRO-2 over grads handed in per step)."""

    phase = "reducescatter"

    def __init__(self, layout):
        self.pool = GradPool(layout, get_device("host"))

    def __call__(self, buf, op, tag):
        raise AssertionError("only recorded")


_FUSES, _PLAIN = "host group of 1 (fuses the pre-multiplied sum)", "group of 2 that does not fuse"
_ROUNDS = "group of 2 that rounds to float16 as it sums"


class _RoundingGroup(FakeGroup):
    """A group that says it gives the fp16 compression's bits on float32 buffers (the host's
    shared memory does), and only those."""

    def fuses_compression(self, device, compression):
        return compression == "float16"


F32 = "float32"
G = [f"{F32}[6]", f"{F32}[10]"]  # the two grads, in bucket order
B = f"{F32}[20]"  # the bucket's buffer
TAG = "bucket 0 (80 B)"
OFFS = [0, 8]
FLAG = "int32[1]"


def _python(flag, scale):
    """PythonReducer's steps: per grad, the scale (when there is one), the reduce, the check."""
    steps = []
    for i, g, n in zip((1, 0), G, (24, 40)):
        if scale != 1.0 or flag:
            steps.append(("pack", 0, n, "scale_checked", (g, scale, FLAG if flag else None), ""))
        op = "sum" if scale != 1.0 else "avg"
        steps.append(("allreduce", 0, n, "AllReduce", (g, op, f"grad {i} of {TAG}"), ""))
        if flag:
            steps.append(("unpack", 0, n, "flag_nonfinite", ([g], g, [0], FLAG), ""))
    return steps


_PACK = "pack(nonfinite_flag={}, scale={})"
_UNPACK = "unpack(nonfinite_flag={})"
PATHS = {
    # (group, mode, hook, flag, average_in_collective, divisor, pooled): the steps
    "python": ((_PLAIN, "per_grad", None, False, False, None, False), _python(False, 0.5)),
    "python, AVG": ((_PLAIN, "per_grad", None, False, True, None, False), _python(False, 1.0)),
    "python, flag": ((_PLAIN, "per_grad", None, True, False, None, False), _python(True, 0.5)),
    "view": (
        (_PLAIN, "view", None, False, False, None, False),
        [("pack", 0, 80, "scale_", (B, 0.5), ""), ("allreduce", 0, 80, "AllReduce", (B, "sum", TAG), "")],
    ),
    "view, AVG": (
        (_PLAIN, "view", None, False, True, None, False),
        [("allreduce", 0, 80, "AllReduce", (B, "avg", TAG), "")],
    ),
    "view, flag": (
        (_PLAIN, "view", None, True, False, None, False),
        [
            ("pack", 0, 80, "scale_flagged", (B, 0.5, FLAG), ""),
            ("allreduce", 0, 80, "AllReduce", (B, "sum", TAG), ""),
            ("unpack", 0, 80, "flag_nonfinite", (G, B, OFFS, FLAG), ""),
        ],
    ),
    "view, pre-multiplied sum": (
        (_FUSES, "view", None, False, False, 2, False),
        [("allreduce", 0, 80, "premul_sum", (B, 0.5, TAG), "")],
    ),
    "view, pre-multiplied sum, AVG": (
        (_FUSES, "view", None, False, True, None, False),  # scale 1: nothing to fuse
        [("allreduce", 0, 80, "AllReduce", (B, "avg", TAG), "")],
    ),
    "view, pre-multiplied sum, flag": (  # the flag needs its pass: no fusing
        (_FUSES, "view", None, True, False, 2, False),
        [
            ("pack", 0, 80, "scale_flagged", (B, 0.5, FLAG), ""),
            ("allreduce", 0, 80, "AllReduce", (B, "sum", TAG), ""),
            ("unpack", 0, 80, "flag_nonfinite", (G, B, OFFS, FLAG), ""),
        ],
    ),
    "pack": (
        (_PLAIN, "pack", None, False, False, None, False),
        [
            ("pack", 0, 80, _PACK.format(None, 0.5), (G, B, OFFS), ""),
            ("allreduce", 0, 80, "AllReduce", (B, "sum", TAG), ""),
            ("unpack", 0, 80, _UNPACK.format(None), (G, B, OFFS), ""),
        ],
    ),
    "pack, pre-multiplied sum": (  # only a view bucket fuses (a pack scales in its own pass)
        (_FUSES, "pack", None, False, False, 2, False),
        [
            ("pack", 0, 80, _PACK.format(None, 0.5), (G, B, OFFS), ""),
            ("allreduce", 0, 80, "AllReduce", (B, "sum", TAG), ""),
            ("unpack", 0, 80, _UNPACK.format(None), (G, B, OFFS), ""),
        ],
    ),
    "pack, AVG, flag": (
        (_PLAIN, "pack", None, True, True, None, False),
        [
            ("pack", 0, 80, _PACK.format(FLAG, 1.0), (G, B, OFFS), ""),
            ("allreduce", 0, 80, "AllReduce", (B, "avg", TAG), ""),
            ("unpack", 0, 80, _UNPACK.format(FLAG), (G, B, OFFS), ""),
        ],
    ),
    "pack, pooled": (
        (_PLAIN, "pack", None, False, True, None, True),
        [
            ("pack", 0, 80, "clear", (0,), ""),
            ("pack", 0, 80, _PACK.format(None, 1.0), (G, B, OFFS), ""),
            ("reducescatter", 0, 80, "_Pooled", (B, "avg", TAG), ""),
            ("unpack", 0, 80, _UNPACK.format(None), (G, B, OFFS), ""),
        ],
    ),
    "compressed, view": (
        (_PLAIN, "view", hooks.bf16_compress, False, True, None, False),  # (compressed: always SUM)
        [
            ("pack", 0, 80, _PACK.format(None, 0.5), ([B], "bfloat16[20]", [0]), ""),
            ("allreduce", 0, 40, "AllReduce", ("bfloat16[20]", "sum", TAG), "bfloat16"),
            ("unpack", 0, 80, _UNPACK.format(None), ([B], "bfloat16[20]", [0]), ""),
        ],
    ),
    "compressed, pack, flag": (
        (_PLAIN, "pack", hooks.fp16_compress, True, False, None, False),
        [
            ("pack", 0, 80, _PACK.format(FLAG, 0.5), (G, "float16[20]", OFFS), ""),
            ("allreduce", 0, 40, "AllReduce", ("float16[20]", "sum", TAG), "float16"),
            ("unpack", 0, 80, _UNPACK.format(FLAG), (G, "float16[20]", OFFS), ""),
        ],
    ),
    "compressed, pre-multiplied sum": (  # the compression's pack scales: no fusing
        (_FUSES, "view", hooks.fp16_compress, False, False, 2, False),
        [
            ("pack", 0, 80, _PACK.format(None, 0.5), ([B], "float16[20]", [0]), ""),
            ("allreduce", 0, 40, "AllReduce", ("float16[20]", "sum", TAG), "float16"),
            ("unpack", 0, 80, _UNPACK.format(None), ([B], "float16[20]", [0]), ""),
        ],
    ),
    "compressed, view, on a group that rounds as it sums": (  # one step, fp16's wire bytes
        (_ROUNDS, "view", hooks.fp16_compress, False, True, None, False),
        [("allreduce", 0, 40, "compressed_sum", (B, 0.5, "float16", TAG), "float16")],
    ),
    "compressed, view, flag, on a group that rounds as it sums": (  # the flag: pack and unpack
        (_ROUNDS, "view", hooks.fp16_compress, True, False, None, False),
        [
            ("pack", 0, 80, _PACK.format(FLAG, 0.5), ([B], "float16[20]", [0]), ""),
            ("allreduce", 0, 40, "AllReduce", ("float16[20]", "sum", TAG), "float16"),
            ("unpack", 0, 80, _UNPACK.format(FLAG), ([B], "float16[20]", [0]), ""),
        ],
    ),
    "compressed bf16, view, on a group that rounds fp16 only": (
        (_ROUNDS, "view", hooks.bf16_compress, False, False, None, False),
        [
            ("pack", 0, 80, _PACK.format(None, 0.5), ([B], "bfloat16[20]", [0]), ""),
            ("allreduce", 0, 40, "AllReduce", ("bfloat16[20]", "sum", TAG), "bfloat16"),
            ("unpack", 0, 80, _UNPACK.format(None), ([B], "bfloat16[20]", [0]), ""),
        ],
    ),
    "hook, view": (
        (_PLAIN, "view", _hook, False, False, None, False),
        [("hook", 0, 80, "run_comm_hook", ("BucketLayout", 0, "view", [], B, None, None, "hook"), "")],
    ),
    "hook, pack, flag": (
        (_FUSES, "pack", _hook, True, False, 2, False),
        [("hook", 0, 80, "run_comm_hook", ("BucketLayout", 0, "pack", G, B, FLAG, None, "hook"), "")],
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_each_path_queues_todays_steps(path):
    (group_kind, mode, hook, flag, avg, divisor, pooled), want = PATHS[path]
    specs = [ParamSpec((10,), np.dtype(np.float32)), ParamSpec((6,), np.dtype(np.float32))]
    layout = assign_buckets(specs)
    assert len(layout.buckets) == 1 and layout.buckets[0].padded == 20
    kinds = {_PLAIN: FakeGroup, _ROUNDS: _RoundingGroup}
    group = HostProcessGroup(None, 0, 1) if group_kind == _FUSES else kinds[group_kind](_Shared(2, 5.0), 0, 2)
    try:
        sub = BucketSubmitter(
            group,
            get_device("host"),
            None,
            specs=specs,
            params=[np.zeros(10, np.float32), np.zeros(6, np.float32)],
            average_in_collective=avg,
            label=str,
            collective=_Pooled(layout) if pooled else None,
        )
        sub.prof = _Recorder()
        if hook is not None:
            sub.comm_hook = (None, hook)
        buf = np.zeros(20, np.float32)
        grads = [] if mode == "view" else [np.zeros(6, np.float32), np.zeros(10, np.float32)]
        if mode == "per_grad":
            buf, grads = None, [np.zeros(6, np.float32), np.zeros(10, np.float32)]
        sub.submit(layout, 0, mode, grads, buf, np.zeros(1, np.int32) if flag else None, divisor)
        assert sub.prof.steps == want
    finally:
        group.shutdown()


class _Device:
    def __init__(self, kind):
        self.kind = kind


def test_the_group_says_whether_it_fuses_the_scale():
    """The device choice is the group's: the host backend fuses the pre-multiplied sum on its
    own (NumPy) buffers, not on another device's; a group that says nothing does not."""
    host = HostProcessGroup(None, 0, 1)
    plain = FakeGroup(_Shared(1, 5.0), 0, 1)
    try:
        assert AllReduce(host, get_device("host")).fuses_scale
        assert not host.fuses_premul_sum(_Device("cuda"))
        assert not host.fuses_compression(get_device("host"), "float16")  # 1 rank: no shm transport
        assert not plain.fuses_compression(get_device("host"), "float16")
        assert not AllReduce(plain, get_device("host")).fuses_scale
    finally:
        host.shutdown()
        plain.shutdown()
