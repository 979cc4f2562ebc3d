"""The models, data and loops the fully_shard tests share (tests/adapters/torch_tests/fsdp/): torch's
own test Transformer (torch.testing._internal.distributed._tensor.common_dtensor, in the wheel;
nanoGPT-shaped: embeddings, attention + MLP blocks, a norm and an output head), sharded per block
and then at the root as FSDP2's tests do, and trained with rank-dependent tokens."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, List, Optional

VOCAB, SEQ = 64, 16


def transformer(n_layers: int = 2, weight_tying: bool = False) -> Any:
    """torch's test Transformer (dim 32, 2 heads), the same on every rank (seed 42)."""
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(42)
    args = ModelArgs(
        n_layers=n_layers,
        n_heads=2,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        dim=32,
        dropout_p=0.0,
        weight_tying=weight_tying,
    )
    return Transformer(args)


def tied(vocab: int, dim: int = 16) -> Any:
    """An embedding and an output head sharing one weight of `vocab` rows (torch's TiedModel)."""
    import torch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(vocab, dim)
            self.output = torch.nn.Linear(dim, vocab, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids: Any) -> Any:
            return self.output(self.tok_embeddings(ids))

    return Tied()


def chunked_head() -> Any:
    """body (Linear), norm (RMSNorm) and head (Linear 8 -> 16); `forward(x, skip_head=True)`
    stops before the head, which a chunked loss then runs on its own (torch's ChunkedHeadModel,
    smaller)."""
    import torch

    class ChunkedHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 8, bias=False)
            self.norm = torch.nn.RMSNorm(8)
            self.head = torch.nn.Linear(8, 16, bias=False)

        def forward(self, x: Any, skip_head: bool = False) -> Any:
            h = self.norm(self.body(x))
            return h if skip_head else self.head(h)

    return ChunkedHead()


def shard_blocks(model: Any, fully_shard: Callable[..., Any], **kw: Any) -> Any:
    """fully_shard on every TransformerBlock, then on the root (FSDP2's recipe)."""
    from torch.testing._internal.distributed._tensor.common_dtensor import TransformerBlock

    for m in model.modules():
        if isinstance(m, TransformerBlock):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def tokens(rank: int, steps: int, micro: int = 1) -> List[List[Any]]:
    """steps x micro batches of (2, SEQ) tokens, different on every rank."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(micro)] for _ in range(steps)]


def train(
    model: Any,
    opt: Any,
    data: List[List[Any]],
    *,
    clip: Optional[float] = None,
    sync: Optional[Callable[[Any, bool], None]] = None,
) -> dict:
    """One optimizer step per entry of `data` (its micro-batches accumulated; `sync(model,
    last)` before each, e.g. set_requires_gradient_sync). Returns the losses per step and the
    clipped norms (float values)."""
    import torch

    losses, norms = [], []
    for micro in data:
        opt.zero_grad()
        total = 0.0
        for k, x in enumerate(micro):
            if sync is not None:
                sync(model, k == len(micro) - 1)
            loss = model(x).float().mean()
            loss.backward()
            total += loss.item()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor()))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms}


def full_params(model: Any) -> dict:
    """Every parameter unsharded (DTensor.full_tensor: collective), as NumPy, by name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = t.detach().float().numpy().copy()
    return out


@contextlib.contextmanager
def gloo(rank: int, world: int, store_dir: str) -> Any:
    """torch.distributed on gloo (what torch's fully_shard and the DTensors use); our group joins
    beside it at the first fully_shard and is destroyed with it."""
    import torch
    import torch.distributed as dist

    import nccl_ddp as nd

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(store_dir, 'gloo')}", rank=rank, world_size=world
    )
    try:
        yield
    finally:
        if nd.is_initialized():
            nd.destroy_process_group()
        dist.destroy_process_group()


def assert_same_run(ours: dict, ref: dict, keys: tuple, where: Any) -> None:
    """`ours` and `ref` (torch's) equal in each of `keys` and in every trained parameter, bit
    for bit; `where` names the rank and setting in the message."""
    import numpy as np

    for key in keys:
        assert ours[key] == ref[key], (where, key)
    for name, value in ref["params"].items():
        np.testing.assert_array_equal(ours["params"][name], value, err_msg=f"{where} {name}")


def torch_and_ours() -> list:
    """[("torch", torch's fully_shard), ("ours", nccl_ddp.fully_shard)]."""
    from torch.distributed.fsdp import fully_shard

    import nccl_ddp as nd

    return [("torch", fully_shard), ("ours", nd.fully_shard)]
