"""`nd.ShardedParams` over Paddle tensors, one rank of a 2-rank job under nccl-ddp-run in the
Paddle venv (tests/adapters/paddle_tests/test_paddle_sharded_params.py runs it):

    python -m nccl_ddp.launch --nproc-per-node 2 tests/support/paddle_sharded.py OUT_DIR

Each rank builds the same float32 tensors (uneven dim-0 sizes), 2 units, and steps ShardAdamW on
grads of its own for STEPS steps; it writes OUT_DIR/rank<r>.npz (the gathered parameters) and
OUT_DIR/rank<r>.json (the gathered types, the refusals' messages). The test compares them with
the same optimizer run unsharded on the mean grads."""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np

import nccl_ddp as nd
from nccl_ddp.errors import ConfigError, ConfigTypeError

SHAPES = [(37, 23), (23,), (5, 3), (1,)]
UNITS = [[0, 1], [2, 3]]
STEPS = 4


def init():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def grads(rank, step):
    rng = np.random.default_rng([rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def opt():
    return nd.ShardAdamW(lr=1e-2, weight_decay=0.1)


def main(out: str) -> None:
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle  # here: the test imports this module for its data, without Paddle

    nd.init_process_group()
    rank = nd.get_rank()
    params = [paddle.to_tensor(x) for x in init()]
    sp = nd.ShardedParams(params, opt(), units=UNITS)
    del params
    seen = {}
    for step in range(STEPS):
        full = sp.gather()
        seen["types"] = sorted({type(t).__name__ for t in full + sp.gather_unit(1)})
        sp.step([paddle.to_tensor(g) for g in grads(rank, step)])
    for what, bad in [
        ("numpy", grads(rank, 0)),
        ("short", [paddle.to_tensor(g) for g in grads(rank, 0)[:3]]),
    ]:
        try:
            sp.step(bad)
        except (ConfigError, ConfigTypeError) as e:
            seen[what] = str(e)
    final = [t.numpy() for t in sp.gather()]
    sp.close()
    np.savez(os.path.join(out, f"rank{rank}.npz"), *final)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"paddle_sharded: rank {rank} done", flush=True)
    nd.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
