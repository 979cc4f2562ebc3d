"""Ray Train's TorchTrainer on a local Ray cluster, 2 CPU workers, run in .venv-ray
(scripts/setup_ray_venv.sh) by tests/adapters/torch_tests/integrations/test_ray_train.py: the same training
loop with torch's
DDP (Ray's `prepare_model` recipe wraps in it), with `nd.init_process_group()` + our DDP beside
Ray's torch.distributed, and with our DDP alone (it joins our group by itself). Each worker saves
its final state; the driver prints one JSON line: per variant and rank, the largest difference from
torch DDP's run.

    python tests/support/ray_train_job.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

VARIANTS = ("torch", "ours", "ours-auto")


def loop(config: dict) -> None:
    import ray.train
    import torch

    import nccl_ddp as nd

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(1234 + rank)  # per rank: DDP starts every rank from rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if config["ddp"] == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        if config["ddp"] == "ours":
            nd.init_process_group()  # beside Ray's torch.distributed: no port of its is bound
        ddp = nd.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.savez(os.path.join(config["out"], f"{config['ddp']}-{rank}.npz"), **state)
    if config["ddp"] == "ours":
        nd.destroy_process_group()


def main(out: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        for variant in VARIANTS:
            TorchTrainer(
                loop,
                train_loop_config={"ddp": variant, "out": out},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                torch_config=TorchConfig(backend="gloo"),
                run_config=RunConfig(storage_path=os.path.join(out, "ray"), name=variant),
            ).fit()
    finally:
        ray.shutdown()
    diffs: dict = {}
    for variant in VARIANTS[1:]:
        for rank in (0, 1):
            ref = np.load(os.path.join(out, f"torch-{rank}.npz"))
            got = np.load(os.path.join(out, f"{variant}-{rank}.npz"))
            diffs[f"{variant} rank {rank}"] = max(float(np.abs(ref[k] - got[k]).max()) for k in ref.files)
    print(json.dumps(diffs))


if __name__ == "__main__":
    main(sys.argv[1])
