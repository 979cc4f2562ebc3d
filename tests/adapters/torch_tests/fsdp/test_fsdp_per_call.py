"""A unit's post-backward runs once per forward call whose inputs need a grad, each reducing what
backward added to the unit's grads since (torch 2.13's FSDP2, whose reductions are the spec: the
sharded grads bit for bit equal to torch's own fully_shard over gloo at 2 ranks, after every
backward):
- a unit run twice in one forward on inputs that need a grad (as torch's, a post-backward per
  call, each reducing what grads there are by then), over two micro-batches a step, the first
  with `reshard_after_backward` True or False; and two forwards, then a backward of each (each
  backward reduces its own grads), with `reshard_after_backward` True or False; and under
  torch's activation checkpointing (`checkpoint(module)`: recomputed in backward);
- the module of a grouped unit that the root's forward skipped, run apart over chunks with a
  backward each (its sharded grad set, and grown, after every chunk's backward);
- micro-batches without gradient sync, then one with it, the last over chunks (the kept local
  grads go into the first reduction of the synchronised backward), grouped and not."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import chunked_head, full_params, gloo, torch_and_ours  # noqa: E402
from mp import outcome, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Twice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.inner, self.last = (
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 4),
        )

    def forward(self, x):
        return self.last(self.inner(torch.tanh(self.inner(self.first(x)))))  # inner's inputs need a grad


def _grads(params: dict) -> dict:
    """Every sharded grad, unsharded (collective), by name; None where there is none."""
    return {n: None if p.grad is None else p.grad.full_tensor().numpy().copy() for n, p in params.items()}


def _twice(fs, rank: int, keep: bool) -> list:
    """Two micro-batches a step; `keep`: the first without `reshard_after_backward` (the unit
    stays gathered into the next forward, torch's 1F1B pattern)."""
    torch.manual_seed(0)
    model = _Twice()
    fs(model.inner)
    fs(model)
    params = dict(model.named_parameters())  # the sharded ones (a gathered unit registers others)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(2):
        for micro in range(2):
            model.set_reshard_after_backward(not keep or micro == 1)
            torch.manual_seed(100 + 10 * step + micro + rank)
            model(torch.randn(6, 8)).pow(2).mean().backward()
            seen.append(_grads(params))
        opt.step()
        opt.zero_grad()
    return seen + [full_params(model)]


def _checkpointed(fs, rank: int) -> list:
    """The twice-run unit under torch's activation checkpointing (recomputed in backward)."""
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    model = _Twice()
    checkpoint(model.inner)
    fs(model.inner)
    fs(model)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(2):
        torch.manual_seed(100 + 10 * step + rank)
        model(torch.randn(6, 8)).pow(2).mean().backward()
        seen.append(_grads(params))
        opt.step()
        opt.zero_grad()
    return seen + [full_params(model)]


def _two_then_two(fs, rank: int, keep: bool) -> list:
    """Two forwards, then a backward of each: every unit runs twice before its first backward."""
    torch.manual_seed(0)
    model = _Twice()
    fs(model.inner)
    fs(model)
    model.set_reshard_after_backward(not keep)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(2):
        torch.manual_seed(100 + 10 * step + rank)
        losses = [model(torch.randn(6, 8)).pow(2).mean() for _ in range(2)]
        for loss in losses:
            loss.backward()
            seen.append(_grads(params))
        model.set_reshard_after_backward(True)
        model.reshard()  # (not recursive: the root's unit; inner's resharded at its post-backward)
        opt.step()
        opt.zero_grad()
        model.set_reshard_after_backward(not keep)
    return seen + [full_params(model)]


def _sharded_chunked(fs, grouped: bool):
    """`chunked_head()` with [norm, head] one unit (`grouped`) or a unit each, then the root."""
    torch.manual_seed(0)
    model = chunked_head()
    if grouped:
        fs([model.norm, model.head])
    else:
        fs(model.norm)
        fs(model.head)
    return fs(model)


def _chunked(fs, rank: int, grouped: bool) -> list:
    model = _sharded_chunked(fs, grouped)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(2):
        torch.manual_seed(100 + 10 * step + rank)
        h = model(torch.randn(6, 8), skip_head=True)
        c = h.detach().requires_grad_(True)
        for chunk in torch.chunk(c, 3):
            model.head(chunk).pow(2).mean().backward()
            seen.append(_grads(params))  # head's grad after each chunk's backward
        h.backward(c.grad)
        seen.append(_grads(params))
        opt.step()
        opt.zero_grad()
    return seen + [full_params(model)]


def _accumulated(fs, rank: int, grouped: bool) -> list:
    model = _sharded_chunked(fs, grouped)
    params = dict(model.named_parameters())
    seen = []
    for micro in range(3):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        torch.manual_seed(100 + micro + rank)
        h = model(torch.randn(6, 8), skip_head=True)
        c = h.detach().requires_grad_(True)
        for chunk in torch.chunk(c, 2):
            model.head(chunk).sum().backward()
        h.backward(c.grad)
        seen.append(_grads(params))
    return seen


def _reshard_ints(fs, rank: int, inner: int = 1, root: int = 2) -> list:
    """FSDP2's int `reshard_after_forward` (by default 1 on the inner unit: kept gathered after
    forward, the group's size 2 on the root: resharded); what the module holds after forward,
    then a step's grads."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _Twice()
    fs(model.inner, reshard_after_forward=inner)
    fs(model, reshard_after_forward=root)
    params = dict(model.named_parameters())
    torch.manual_seed(100 + rank)
    loss = model(torch.randn(6, 8)).pow(2).mean()
    held = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    loss.backward()
    return [held, _grads(params)]


CASES = {
    "reshard-ints": _reshard_ints,
    "twice": lambda fs, rank: _twice(fs, rank, True),
    "twice-keep": lambda fs, rank: _twice(fs, rank, False),
    "checkpointed": _checkpointed,
    "two-then-two": lambda fs, rank: _two_then_two(fs, rank, False),
    "two-then-two-keep": lambda fs, rank: _two_then_two(fs, rank, True),
    "apart": lambda fs, rank: _chunked(fs, rank, True),
    "apart-ungrouped": lambda fs, rank: _chunked(fs, rank, False),
    "accum": lambda fs, rank: _accumulated(fs, rank, True),
    "accum-ungrouped": lambda fs, rank: _accumulated(fs, rank, False),
}


def _runs(rank: int, world: int, store_dir: str) -> dict:
    out = {}
    with gloo(rank, world, store_dir):
        for (name, run), (who, fs) in itertools.product(CASES.items(), torch_and_ours()):
            out[name, who] = outcome(lambda: run(fs, rank))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("fsdp-per-call")), timeout=240)


def _same(ranks, name) -> None:
    for rank, got in enumerate(ranks):
        ref, ours = got[name, "torch"], got[name, "ours"]
        assert ref[0] == "ok", (rank, ref)
        assert ours[0] == "ok", (rank, ours)
        assert len(ours[1]) == len(ref[1])
        for i, (o, r) in enumerate(zip(ours[1], ref[1])):
            assert o.keys() == r.keys()
            for pname, value in r.items():
                where = f"rank {rank} {name} snapshot {i} {pname}"
                assert (o[pname] is None) == (value is None), where
                if value is not None:
                    np.testing.assert_array_equal(o[pname], value, err_msg=where)


@pytest.mark.parametrize("name", ["twice", "twice-keep", "two-then-two", "two-then-two-keep", "checkpointed"])
def test_a_unit_run_twice_reduces_per_call_like_torch(ranks, name):
    _same(ranks, name)


def test_int_reshard_after_forward_one_and_group_size_like_torch(ranks):
    _same(ranks, "reshard-ints")
    held = ranks[0]["reshard-ints", "ours"][1][0]
    assert held == {
        "first.weight": True,
        "first.bias": True,
        "inner.weight": False,
        "inner.bias": False,
        "last.weight": True,
        "last.bias": True,
    }, held


def _reshard_two_of_three(rank: int, world: int, store_dir: str):
    import nccl_ddp as nd

    with gloo(rank, world, store_dir):
        return outcome(lambda: nd.fully_shard(torch.nn.Linear(4, 6), reshard_after_forward=2))


def test_int_reshard_after_forward_not_a_factor_is_refused(tmp_path):
    """3 ranks cannot be resharded to 2 (torch: a ValueError, not a factor of 3)."""

    for rank, (kind, msg) in enumerate(run_ranks(_reshard_two_of_three, 3, str(tmp_path), timeout=120)):
        assert kind == "ConfigError" and f"rank {rank}" in msg and "reshard_after_forward=2" in msg, msg
        assert "factor of the shard group's size 3" in msg, msg


def _reshard_to_half(rank: int, world: int, store_dir: str) -> dict:
    """reshard_after_forward=2 at 4 ranks (torch: a post-forward mesh of 2): ours warns and
    reshards fully; what each holds after forward and the step's grads, torch's and ours."""
    import warnings

    out = {}
    with gloo(rank, world, store_dir):
        for who, fs in torch_and_ours():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = outcome(lambda: _reshard_ints(fs, rank, inner=2, root=2))
            out[who] = got, [str(w.message) for w in caught if "post-forward mesh" in str(w.message)]
    return out


def test_int_reshard_after_forward_a_smaller_factor_reshards_fully_with_a_warning(tmp_path):
    ranks = run_ranks(_reshard_to_half, 4, str(tmp_path), timeout=240)
    for rank, got in enumerate(ranks):
        (ref, _), (ours, warned) = got["torch"], got["ours"]
        assert ref[0] == "ok" and ours[0] == "ok", (rank, ref, ours)
        assert ours[1][0] == ref[1][0] and all(ours[1][0].values()), (rank, ours[1][0])
        assert len(warned) == 2 and f"rank {rank}" in warned[0], warned
        for pname, value in ref[1][1].items():  # (4 ranks: gloo sums in another order than ours)
            np.testing.assert_allclose(
                ours[1][1][pname], value, rtol=1e-5, atol=1e-8, err_msg=f"rank {rank} {pname}"
            )


@pytest.mark.parametrize("name", ["apart", "apart-ungrouped"])
def test_a_module_run_apart_has_its_grad_after_each_backward_like_torch(ranks, name):
    _same(ranks, name)
    for got in ranks:
        heads = [g["head.weight"] for g in got[name, "ours"][1][:3]]  # the first step's chunks
        assert all(h is not None for h in heads)
        assert all(np.abs(b - a).sum() > 0 for a, b in zip(heads, heads[1:]))  # each chunk adds


@pytest.mark.parametrize("name", ["accum", "accum-ungrouped"])
def test_accumulation_without_sync_then_chunks_like_torch(ranks, name):
    _same(ranks, name)
