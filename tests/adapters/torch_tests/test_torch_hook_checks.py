"""`register_comm_hook` / `_register_builtin_comm_hook` of our torch DDP check what torch's check,
with torch's error types and messages, and no other type (a ValueError of torch's is no
RuntimeError of ours; DDP of a module without parameters is a RuntimeError in both), 2 CPU
processes, torch's DDP on gloo beside ours doing the same: a hook that is not callable, a bucket
or return annotation that is not torch's, a second registration, a hook whose result is no
Future; and a hook's Future is passed through as torch passes it (the `then` callback's value is
the grad: c10d's test_ddp_comm_hook_future_passing).
"""

# no `from __future__ import annotations`: the hooks' annotations are the objects torch compares

import pytest
from torch_gloo import beside_torch, on_two_ranks, raised

pytest.importorskip("torch", reason="PyTorch is not installed")

MISUSES = (
    "no parameter",
    "not callable",
    "bucket annotation",
    "return annotation",
    "twice",
    "builtin, then a hook",
    "no Future",
)


def _module():
    import torch

    class Task(torch.nn.Module):  # c10d's ModuleForDdpCommHook: p + x + rank
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(2, 2))

        def forward(self, x, rank):
            return self.p + x + rank

    return Task()


def _hooks() -> dict:
    """The misuses, each `model -> None`, run on a fresh model of each DDP."""
    import torch
    import torch.distributed as dist

    def fine(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def bucket_int(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def returns_int(state: object, bucket: dist.GradBucket) -> int:
        return 0

    def no_future(state, bucket):
        return 1

    def backward(model):
        model(8, dist.get_rank()).mean().backward()

    def builtin_then_hook(model):
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        model.register_comm_hook(None, fine)

    return {
        "not callable": lambda m: m.register_comm_hook(state=None, hook=1),
        "bucket annotation": lambda m: m.register_comm_hook(state=None, hook=bucket_int),
        "return annotation": lambda m: m.register_comm_hook(state=None, hook=returns_int),
        "twice": lambda m: [m.register_comm_hook(None, fine) for _ in range(2)],
        "builtin, then a hook": builtin_then_hook,
        "no Future": lambda m: (m.register_comm_hook(None, no_future), backward(m)),
    }


def _simple_hook(state, bucket):
    """c10d's _simple_hook: a Future of ones, then ones added."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))
    return fut.then(lambda f: f.value() + torch.ones_like(f.value()))


def _hook_checks(rank: int, world: int, store: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    both = (("torch", TorchDDP), ("ours", nd.DistributedDataParallel))
    out: dict = {}
    with beside_torch(rank, world, store):
        for who, ddp in both:
            model = ddp(_module())
            model.register_comm_hook(None, _simple_hook)
            model(8, rank).mean().backward()
            out["future passing", who] = [p.grad.tolist() for p in model.parameters()]
        for who, ddp in both:
            out["no parameter", who] = raised(lambda: ddp(torch.nn.Module()))
        for name, misuse in _hooks().items():  # "no Future" last: it breaks our group
            for who, ddp in both:
                out[name, who] = raised(lambda: misuse(ddp(_module())))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_comm_hook_checks_are_torchs(tmp_path):
    for r in on_two_ranks(_hook_checks, tmp_path):
        for name in MISUSES:
            theirs, ours = r[name, "torch"], r[name, "ours"]
            assert theirs is not None and ours is not None, name
            for builtin in (RuntimeError, ValueError, TypeError):  # torch's class, and no other
                assert issubclass(ours[0], builtin) == issubclass(theirs[0], builtin), (name, ours, theirs)
            if name != "no Future":  # torch's reducer words this one from C++, with its context
                assert theirs[1].split("\n")[0].strip() in ours[1], (name, ours[1], theirs[1])
            else:
                assert "callback must return a torch.futures.Future object, but got" in ours[1]
        assert r["future passing", "ours"] == r["future passing", "torch"] == [[[2.0, 2.0], [2.0, 2.0]]]
