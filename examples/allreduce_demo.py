"""Smallest nccl_ddp job: every rank contributes rank+1 and all of them receive the sum.

    nccl-ddp-run --nproc-per-node 2 examples/allreduce_demo.py

Uses NCCL on GPUs (one per rank, chosen from LOCAL_RANK) and the host backend without one.
"""

import numpy as np

import nccl_ddp as nd


def main() -> None:
    group = nd.init_process_group()  # rank, world and store from nccl-ddp-run's env
    rank, world = nd.get_rank(), nd.get_world_size()
    if group.backend == "nccl":
        import cupy as xp

        xp.cuda.Device(group.device_id).use()  # the GPU the NCCL group runs on
    else:
        xp = np
    x = xp.full(4, rank + 1, dtype=xp.float32)
    x = nd.all_reduce(x)  # in place; returned for immutable arrays
    expected = world * (world + 1) / 2
    print(
        f"rank {rank}/{world} ({group.backend}): all_reduce -> {x.tolist()}, expected {expected}", flush=True
    )
    nd.barrier()
    nd.destroy_process_group()
    if float(x[0]) != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
