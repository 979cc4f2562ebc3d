"""Between a unit's reduce-scatter in backward and the end of backward, what `fully_shard` keeps
of the unit is its reduced shards and which parameters had a grad: never the unsharded grads
(the whole model's full-size grads alive at once would defeat sharding)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import gloo  # noqa: E402
from mp import run_ranks  # noqa: E402


def _pending(rank: int, world: int, store_dir: str) -> list:
    import nccl_ddp as nd
    from nccl_ddp.adapters.torch.fsdp.unit import Schedule

    seen: list = []
    original = Schedule.end_of_backward

    def end_of_backward(self: Schedule) -> None:
        seen.extend(type(x).__name__ for entry in self.pending for x in entry[3])
        original(self)

    Schedule.end_of_backward = end_of_backward  # type: ignore[method-assign]
    with gloo(rank, world, store_dir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        nd.fully_shard(model[0])
        nd.fully_shard(model[2])
        nd.fully_shard(model)
        model(torch.randn(4, 32)).sum().backward()
    return seen


@pytest.mark.slow
def test_backward_keeps_no_unsharded_grad_until_its_end(tmp_path):
    for seen in run_ranks(_pending, 2, str(tmp_path), timeout=120):
        assert seen and set(seen) == {"bool"}, seen
