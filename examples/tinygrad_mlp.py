"""Data-parallel tinygrad training through NumPy: the path for any framework whose tensors have no
DLPack (`__dlpack__`) but convert to and from NumPy (`t.numpy()`, `Tensor(array)`).

    nccl-ddp-run --nproc-per-node 2 examples/tinygrad_mlp.py [--steps N] [--save params.npz]

(tinygrad picks its device; on a machine without clang, `DEV=PYTHON` runs its Python backend.)

nccl_ddp exchanges arrays through DLPack, so it refuses tinygrad tensors with an error that names
this way out: hand it NumPy copies and copy the results back. Here every rank
1. takes rank 0's initial weights (`nd.broadcast` on NumPy copies, assigned back),
2. computes its grads on its shard of the global batch with tinygrad's backward,
3. averages them with `DistributedGradReducer` built on NumPy arrays of the parameters' shapes
   and dtypes (`reducer([p.grad.numpy() ...])`: one copy out of tinygrad, bucketed all-reduce),
4. puts the mean grads back (`p.grad = Tensor(g)`, one copy in) and steps tinygrad's optimizer.
With equal shards and a mean loss, every rank ends with the parameters of one process training
on the whole batch (up to float32 rounding). Rank 0 prints a checksum and writes --save.
"""

from __future__ import annotations

import argparse

import numpy as np
from tinygrad import Tensor, nn
from tinygrad.helpers import Context
from tinygrad.nn.state import get_parameters

import nccl_ddp as nd

SIZES = (8, 32, 4)  # in, hidden, out
GLOBAL_BATCH = 32
LR = 0.1


class MLP:
    def __init__(self) -> None:
        self.l1 = nn.Linear(SIZES[0], SIZES[1])
        self.l2 = nn.Linear(SIZES[1], SIZES[2])

    def __call__(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).tanh())


def global_batch(step: int) -> tuple:
    """The step's whole batch (every rank makes the same one and takes its shard)."""
    g = np.random.default_rng(step)
    x = g.standard_normal((GLOBAL_BATCH, SIZES[0]), dtype=np.float32)
    y = np.sin(x[:, : SIZES[-1]]).astype(np.float32)
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save", default="", help="write rank 0's final parameters here (.npz)")
    args = p.parse_args()

    nd.init_process_group()
    rank, world = nd.get_rank(), nd.get_world_size()
    Tensor.manual_seed(rank)  # different initial weights per rank: the broadcast evens them out
    model = MLP()
    params = get_parameters(model)

    # 1. rank 0's weights everywhere: NumPy copies through nd.broadcast, assigned back
    for prm in params:
        a = prm.numpy()
        nd.broadcast(a, 0)
        prm.assign(Tensor(a)).realize()

    # 3. the reducer takes NumPy arrays: built on NumPy arrays of the parameters' shapes/dtypes
    reducer = nd.DistributedGradReducer([prm.numpy() for prm in params])
    opt = nn.optim.SGD(params, lr=LR)
    with Context(TRAINING=1):
        for step in range(args.steps):
            x, y = global_batch(step)
            shard = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
            opt.zero_grad()
            loss = ((model(Tensor(x[shard])) - Tensor(y[shard])) ** 2).mean()
            loss.backward()  # 2. this rank's grads
            grads = reducer([prm.grad.numpy() for prm in params])  # one copy out, the mean back
            for prm, g in zip(params, grads):
                prm.grad = Tensor(g)  # 4. one copy in
            opt.step()
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}", flush=True)

    final = {f"p{i}": prm.numpy() for i, prm in enumerate(params)}
    print(f"rank {rank}: param checksum {sum(float(np.abs(a).sum()) for a in final.values()):.6f}")
    if args.save and rank == 0:
        np.savez(args.save, **final)
    reducer.close()
    nd.destroy_process_group()


if __name__ == "__main__":
    main()
