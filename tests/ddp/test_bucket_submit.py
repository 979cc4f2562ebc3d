"""Bucket submission (nccl_ddp/ddp/bucket_submit.py): what a registered comm hook makes of a
bucket (`HookPath`), and the collective as a choice the reducer's buckets all go through."""

import numpy as np
import pytest
from fakegroup import run_threads

from nccl_ddp import hooks
from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.buckets.layout import ParamSpec, assign_buckets
from nccl_ddp.ddp.bucket_submit import AllReduce, BucketSubmitter, HookPath
from nccl_ddp.ddp.data_parallel import DistributedDataParallel
from nccl_ddp.device import get_device


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
