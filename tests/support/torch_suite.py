"""Runs tests of torch's own DDP suite on 2 CPU ranks over gloo, with torch's
DistributedDataParallel or ours in its place (tests/adapters/torch_tests/test_torch_suite.py):

    NCCL_DDP_TORCH_SUITE=ours|torch python torch_suite.py RESULT.json test_name ...

The tests are the installed wheel's `DistributedTest._DistTestBase`
(torch/testing/_internal/distributed/distributed_test.py), imported here at run time and driven
as pytorch's test/distributed/test_distributed_spawn.py drives them: `TestDistBackend` spawns the
ranks, each starts torch.distributed from a file:// init method and runs the test. With `ours`,
each rank puts our torch wrapper where the tests look up torch's class (the module's
`DistributedDataParallel` and `torch.nn.parallel.DistributedDataParallel`) before the test runs.
RESULT.json gets {name: "pass" | "skip: why" | "fail: the error" | "missing"}.
"""

import json
import os
import sys
import tempfile
import unittest

if "TEMP_DIR" not in os.environ:  # the spawned ranks import this file again: keep the parent's
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="nccl-ddp-torch-suite-")
os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402  (distributed_test reads BACKEND/WORLD_SIZE when imported)
from torch.testing._internal.distributed import distributed_test  # noqa: E402

WHO = os.environ.get("NCCL_DDP_TORCH_SUITE", "ours")


def _ours_in_torchs_place() -> None:
    from nccl_ddp.adapters.torch.ddp import TorchDistributedDataParallel

    torch.nn.parallel.DistributedDataParallel = TorchDistributedDataParallel
    distributed_test.DistributedDataParallel = TorchDistributedDataParallel


class TorchSuite(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """test_distributed_spawn.py's TestDistBackendWithSpawn."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # in each spawned rank
        torch.set_num_threads(1)
        if WHO == "ours":
            _ours_in_torchs_place()
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def _outcome(name: str) -> str:
    if not hasattr(TorchSuite, name):
        return "missing"
    result = unittest.TestResult()
    TorchSuite(name).run(result)
    if result.skipped:
        return f"skip: {result.skipped[0][1]}"
    problems = result.errors + result.failures
    return "pass" if not problems else "fail: " + problems[0][1][-3000:]


def main(argv: list) -> None:
    out, names = argv[1], argv[2:]
    results = {}
    for name in names:
        results[name] = _outcome(name)
        with open(out, "w") as f:  # after each test: a run cut short keeps what it found
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv)
