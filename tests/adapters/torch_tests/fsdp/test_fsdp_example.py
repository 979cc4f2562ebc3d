"""pytorch/examples' distributed/FSDP2/example.py (read with the search tools; not copied), in an
equivalent of our own on CPU with its GPU check removed: a Transformer sharded per layer and at
the root, optionally bf16 parameters with fp32 reduction and explicit prefetching of the next
two layers (forward) and the previous two (backward) with `model.unshard()` before each step,
then `model(x).sum()`, backward, `clip_grad_norm_(1.0)`, Adam (lr 1e-2), 10 steps on the same
random tokens on every rank. Smaller than the example's (4 layers, torch's test Transformer). Built
on CPU, or as the example does on the meta device: sharded there, then `to_empty(device="cpu")` and
each module's `reset_parameters()` from one seed, on the sharded DTensors (so each rank draws its
own shard). Our fully_shard and torch's give the same losses bit for bit, at 2 ranks over gloo."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import SEQ, VOCAB, gloo, torch_and_ours, transformer  # noqa: E402
from mp import run_ranks  # noqa: E402

# (prefetch, bf16, meta)
SETTINGS = {
    "plain": (False, False, False),
    "prefetch+bf16": (True, True, False),
    "meta": (False, False, True),
    "meta+prefetch+bf16": (True, True, True),
}


def _prefetch(model, n: int) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + n])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - n) : i][::-1])


def _init(model) -> None:
    """The example's `model.reset_parameters()`, per module, on the sharded DTensors."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)):
            m.reset_parameters()


def _in_our_shards(model) -> bool:
    """Every fp32 DTensor's local tensor a view of its unit's shard memory (ours only)."""
    from nccl_ddp.adapters.torch.tensors import from_native

    for m in model.modules():
        unit = m._nccl_unit() if hasattr(m, "_nccl_unit") else None
        for p in unit.params if unit is not None else []:
            local = p.sharded.to_local()
            if p.mirror is None and local.data_ptr() != from_native(unit.shards.local(p.index)).data_ptr():
                return False
    return True


def _example(fs, prefetch: bool, bf16: bool, meta: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import nccl_ddp as nd

    if meta:
        with torch.device("meta"):
            model = transformer(4)
    else:
        model = transformer(4)
    kw = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if bf16
        else {}
    )
    for layer in model.layers:
        fs(layer, **kw)
    fs(model, **kw)
    if meta:
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        _init(model)
        model.to("cpu")  # where it is: nothing moves (ours keeps its shard memory)
    shards_ok = fs is not nd.fully_shard or _in_our_shards(model)
    if prefetch:
        _prefetch(model, 2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    losses = []
    for _ in range(10):
        if prefetch:
            model.unshard()
        x = torch.randint(0, VOCAB, (4, SEQ))
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "shards_ok": shards_ok}


def _run(rank: int, world: int, store_dir: str) -> dict:
    with gloo(rank, world, store_dir):
        return {(s, who): _example(fs, *SETTINGS[s]) for s in SETTINGS for who, fs in torch_and_ours()}


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_fsdp2_example_same_losses_as_torch(tmp_path):
    for rank, got in enumerate(run_ranks(_run, 2, str(tmp_path), timeout=240)):
        for setting in SETTINGS:
            ours, ref = got[setting, "ours"]["losses"], got[setting, "torch"]["losses"]
            assert ours == ref, (rank, setting)
            assert ours[-1] != ours[0], (rank, setting)  # it trains
            assert got[setting, "ours"]["shards_ok"], (rank, setting)
        assert got["meta", "ours"]["losses"] != got["plain", "ours"]["losses"], rank  # init on the shards
