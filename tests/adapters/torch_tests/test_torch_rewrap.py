"""One module wrapped, closed and wrapped again, as torch DDP allows (a second `Trainer.fit`, a new
Accelerator's `prepare`), 2 CPU processes, torch's DDP (gloo) doing the same as the oracle:

- wrap, train, `close()`, wrap again in the same group, train, wrap again in a new group, train;
- wrap again WITHOUT closing the first wrapper (it is dropped, as a finished Trainer's is): the
  newest wrapper owns the parameters, the old one's hooks never fire in its backward;
- the old wrappers, used again, raise a ConfigError saying they were closed and why.
Parameters equal torch DDP's to 1e-6 after every phase.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks
from torch_oracle import OracleConfig, gloo_group, make_model, train

pytest.importorskip("torch", reason="PyTorch is not installed")

CONFIG = OracleConfig(steps=2)


def _phases(rank: int, wrap_torch, wrap_ours) -> dict:
    """Train one module through four wrappers; the state after each, plus what the stale
    wrappers said when used again."""
    import torch

    out: dict = {"errors": []}
    for name, wrap in (("torch", wrap_torch), ("ours", wrap_ours)):
        model = make_model(rank)
        first = wrap(model, 0)
        states = [train(first, model, rank, CONFIG)]
        if name == "ours":
            first.close()
            first.close()  # a second close does nothing
        second = wrap(model, 0)  # the same group (ours: the world)
        states.append(train(second, model, rank, CONFIG))
        if name == "ours":
            second.close()
        third = wrap(model, 1)  # a new group (ours: nd.new_group)
        states.append(train(third, model, rank, CONFIG))
        fourth = wrap(model, 1)  # the third is not closed: dropped, as by a finished Trainer
        states.append(train(fourth, model, rank, CONFIG))
        out[name] = states
        if name == "ours":
            for stale in (first, third):
                try:
                    stale(torch.zeros(2, 8))
                except Exception as e:  # noqa: BLE001 - the test reads the type and message
                    out["errors"].append(f"{type(e).__name__}: {e}")
            fourth.close()
    return out


def _run(rank: int, world: int, store: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import nccl_ddp as nd

    torch.set_num_threads(1)
    with gloo_group(rank, world, store):
        nd.init_process_group()
        groups = [None, nd.new_group([0, 1])]

        def ours(module, g):
            return nd.DistributedDataParallel(module, process_group=groups[g], find_unused_parameters=True)

        try:
            return _phases(rank, lambda m, g: TorchDDP(m, find_unused_parameters=True), ours)
        finally:
            nd.destroy_process_group()


@pytest.mark.slow
def test_wrap_close_and_wrap_again_matches_torch(tmp_path):
    results = run_ranks(_run, 2, os.path.join(tmp_path, "store"), timeout=300)
    for rank, r in enumerate(results):
        for phase, (theirs, ours) in enumerate(zip(r["torch"], r["ours"])):
            for key, value in theirs.items():
                np.testing.assert_allclose(
                    ours[key], value, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} phase {phase}: {key}"
                )
        first, third = r["errors"]
        assert first.startswith("ConfigError") and "was closed (close() was called)" in first, first
        assert "was closed (a newer DistributedDataParallel wraps the same parameters)" in third, third
