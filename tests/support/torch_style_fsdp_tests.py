"""A test file of our own written the way torch's FSDP2 test files are (an `FSDPTest` subclass,
`skip_if_lt_x_gpu(2, allow_cpu=True)`, `fully_shard` imported from torch.distributed.fsdp), for
tests/adapters/torch_tests/fsdp/test_torch_fsdp_file.py to run through
tests/support/torch_fsdp_file.py as it runs torch's file. Not collected by our suite (no test_
prefix): run alone on a CPU machine, FSDPTest skips all of it (no accelerators)."""

import copy
import time

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
from torch.testing._internal.common_fsdp import FSDPTest
from torch.testing._internal.common_utils import run_tests

HANG_S = 3600.0


class TestTorchStyleSample(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    @skip_if_lt_x_gpu(2, allow_cpu=True)
    def test_train_step_equals_local(self):
        """Two SGD steps of a fully_shard'ed MLP equal a local copy's on the ranks' mean loss."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        ref = copy.deepcopy(model)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            torch.manual_seed(100 + step)  # every rank draws every rank's batch, uses its own
            batches = [torch.randn(4, 6) for _ in range(self.world_size)]
            model(batches[self.rank]).square().sum().backward()
            opt.step()
            opt.zero_grad()
            (sum(ref(b).square().sum() for b in batches) / self.world_size).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(full.detach(), r.detach(), msg=f"parameter {name}")

    @skip_if_lt_x_gpu(2, allow_cpu=True)
    def test_fully_shard_is_torchs(self):
        """Passes with torch's fully_shard only: the patch reached the ranks or not."""
        self.assertTrue(
            fully_shard.__module__.startswith("torch."), f"fully_shard from {fully_shard.__module__}"
        )

    @skip_if_lt_x_gpu(2, allow_cpu=True)
    def test_planted_failure(self):
        """Fails on rank 1 after a forward of a fully_shard'ed module, with either fully_shard."""
        model = nn.Linear(4, 4)
        fully_shard(model)
        model(torch.ones(2, 4)).sum().backward()
        if self.rank == 1:
            raise AssertionError("planted failure on rank 1")

    @skip_if_lt_x_gpu(2, allow_cpu=True)
    def test_hangs(self):
        """Rank 1 sleeps far past any timeout the driver is given (its ranks must be killed)."""
        fully_shard(nn.Linear(4, 4))
        if self.rank == 1:
            time.sleep(HANG_S)

    @skip_if_lt_x_gpu(2)
    def test_needs_gpus(self):
        """Skipped on a CPU machine whatever the faked accelerator count (no allow_cpu)."""
        fully_shard(nn.Linear(4, 4))


if __name__ == "__main__":
    run_tests()
