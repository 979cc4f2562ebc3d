"""nccl_ddp.fully_shard's FSDP2 contract, one behaviour per test, each named after the test of
torch's test/distributed/_composable/fsdp/test_fully_shard_training.py (torch 2.13.0, read with
the search tools: the file is not in the wheel and no torch code is copied here) that checks it,
and held to torch's own fully_shard over gloo where torch's test holds FSDP2 to a reference.
All cases run in one 2-rank job (the fixture); each case's outcome is kept apart."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import full_params, gloo, shard_blocks, tied, tokens, torch_and_ours, train, transformer  # noqa: E402
from mp import outcome, run_ranks  # noqa: E402

CASES: dict = {}


def case(fn):
    """A case, kept under the name of torch's test it answers (the function's name without
    `torch_`, so pytest does not collect it)."""
    CASES[fn.__name__.removeprefix("torch_")] = fn
    return fn


def _is_dtensor(params) -> list:
    from torch.distributed.tensor import DTensor

    return [isinstance(p, DTensor) for p in params]


def _mlp(dim: int = 8):
    from torch.testing._internal.common_fsdp import MLP

    torch.manual_seed(42)
    return MLP(dim)


def _both(build, shard, steps, rank, opt=lambda ps: torch.optim.Adam(ps, lr=1e-2), data=None, **kw) -> dict:
    """{"torch": train(...), "ours": train(...)} of `shard(build(), fully_shard)`."""
    out = {}
    for who, fs in torch_and_ours():
        model = shard(build(), fs)
        res = train(model, opt(model.parameters()), data or tokens(rank, steps), **kw)
        res["params"] = full_params(model)
        out[who] = res
    return out


@case
def torch_test_param_registration_after_forward(rank):
    """DTensor parameters after fully_shard, after forward with resharding and after reshard();
    plain tensors after forward without; the values are the unsharded model's throughout."""
    import nccl_ddp as nd

    seen = {}
    for reshard in (True, False, None):
        torch.manual_seed(42)
        model = torch.nn.Sequential(_mlp(3), _mlp(3))
        ref = copy.deepcopy(model)
        nd.fully_shard(model[0].in_proj, reshard_after_forward=reshard)
        nd.fully_shard(model[0].out_proj, reshard_after_forward=reshard)
        nd.fully_shard(model, reshard_after_forward=reshard)
        before = _is_dtensor(model.parameters())
        model(torch.randn(2, 3))
        after = _is_dtensor(model.parameters())
        for m in model.modules():
            if isinstance(m, nd.FSDPModule):
                m.reshard()
        same = all(
            np.array_equal(a, b.detach().numpy())
            for a, b in zip(full_params(model).values(), ref.parameters())
        )
        seen[str(reshard)] = (all(before), after, all(_is_dtensor(model.parameters())), same)
    return seen


@case
def torch_test_param_registration_after_backward(rank):
    import nccl_ddp as nd

    model = _mlp(8)
    nd.fully_shard(model.in_proj)
    nd.fully_shard(model.out_proj)
    nd.fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    return all(_is_dtensor(model.parameters())), all(_is_dtensor(p.grad for p in model.parameters()))


@case
def torch_test_train_parity_single_group_shard_dim0(rank):
    """One unit (the root) over uneven dim-0 sizes (7 and 15 rows over 2 ranks), Adam, 5 steps."""
    out = {}
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):

        def build(shapes=shapes):
            torch.manual_seed(42)
            return torch.nn.Sequential(
                torch.nn.Linear(*shapes[0]), torch.nn.ReLU(), torch.nn.Linear(*shapes[1])
            )

        g = torch.Generator().manual_seed(rank)
        data = [[torch.randn(4, shapes[0][0], generator=g)] for _ in range(5)]
        out[str(shapes)] = _both(build, lambda m, fs: fs(m), 5, rank, data=data)
    return out


@case
def torch_test_multi_forward_module(rank):
    """A unit run twice in one forward (its post-backward waits for both backward passes)."""

    class MultiForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)

        def forward(self, x):
            return self.outer(self.inner(x) + self.inner(x))

    def build():
        torch.manual_seed(42)
        return MultiForward()

    def shard(m, fs):
        fs(m.inner)
        return fs(m)

    g = torch.Generator().manual_seed(rank)
    return _both(build, shard, 5, rank, data=[[torch.randn(32, 4, generator=g)] for _ in range(5)])


@case
def torch_test_non_root_forward_backward(rank):
    """A step through the root, then one through a non-root unit alone."""
    out = {}
    for who, fs in torch_and_ours():
        torch.manual_seed(42)
        model = torch.nn.Sequential(*[_mlp(16) for _ in range(3)])
        for m in model:
            fs(m)
        fs(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        losses = []
        for net in (model, model[0]):
            loss = net(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        losses.append(model(x).sum().item())
        out[who] = losses
    return out


@case
def torch_test_explicit_prefetching(rank):
    """set_modules_to_forward_prefetch / _backward_prefetch over 4 blocks, AdamW, 5 steps."""

    def shard(model, fs):
        for layer in model.layers:
            fs(layer)
        fs(model)
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-2]):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        for i, layer in enumerate(layers[2:], start=2):
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
        return model

    return _both(lambda: transformer(4), shard, 5, rank, opt=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


@case
def torch_test_train_parity_with_shared_params(rank):
    """Tied embedding and output weights (both in the root unit), reshard True and False."""
    return {
        str(r): _both(
            lambda: transformer(2, weight_tying=True),
            lambda m, fs: shard_blocks(m, fs, reshard_after_forward=r),
            5,
            rank,
        )
        for r in (True, False)
    }


@case
def torch_test_train_shared_params_uneven_shard(rank):
    """Tied weights of 9 rows over 2 ranks (rank 1's shard padded): every row trains."""
    import nccl_ddp as nd

    torch.manual_seed(42)
    model = nd.fully_shard(tied(9))
    model.unshard()
    first = model.tok_embeddings.weight.detach().clone()
    model.reshard()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(10):
        ids = torch.randint(0, 9, (2, 8), generator=g)
        torch.nn.functional.cross_entropy(model(ids).view(-1, 9), ids.view(-1)).backward()
        opt.step()
        opt.zero_grad()
    model.unshard()
    rows = [not torch.equal(first[r], model.tok_embeddings.weight[r]) for r in range(9)]
    model.reshard()
    return rows, model.tok_embeddings.weight.to_local().shape[0]


@case
def torch_test_gradient_accumulation(rank):
    """3 micro-batches, the first two with set_requires_gradient_sync(False) (their grads stay
    local and are reduced with the last one's), with and without reshard_after_backward."""
    out = {}
    for rab in (True, False):

        def sync(model, last, rab=rab):
            model.set_requires_gradient_sync(last)
            if not rab:
                model.set_reshard_after_backward(last)

        out[str(rab)] = _both(
            lambda: transformer(2),
            lambda m, fs: shard_blocks(m, fs),
            5,
            rank,
            data=tokens(rank, 5, micro=3),
            sync=sync,
        )
    return out


@case
def torch_test_1f1b_microbatching(rank):
    """reshard_after_forward=False, every unit unsharded ahead with unshard(async_op=True), grads
    reduced on the last micro-batch only."""
    import nccl_ddp as nd

    out = {}
    for who, fs in torch_and_ours():
        model = shard_blocks(transformer(2), fs, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handles = [m.unshard(async_op=True) for m in model.modules() if isinstance(m, (nd.FSDPModule,))]
        for h in handles:
            if h is not None:
                h.wait()
        losses = []
        micro = tokens(rank, 1, micro=3)[0]
        for k, x in enumerate(micro):
            model.set_requires_gradient_sync(k == 2)
            loss = model(x).sum()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        out[who] = {"losses": losses, "params": full_params(model)}
    return out


@case
def torch_test_clip_grad_norm_on_sharded_grads(rank):
    """torch.nn.utils.clip_grad_norm_ on the DTensor grads: the unsharded norm, as torch's."""
    return _both(lambda: transformer(2), lambda m, fs: shard_blocks(m, fs), 5, rank, clip=0.5)


@case
def torch_test_mixed_precision_bf16_params_fp32_reduce(rank):
    """MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): bf16 all-gather and
    compute, fp32 reduce-scatter, fp32 sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _both(lambda: transformer(2), lambda m, fs: shard_blocks(m, fs, mp_policy=mp), 5, rank)


@case
def torch_test_root_no_forward_inputs(rank):
    import nccl_ddp as nd

    class OnlyParam(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self):
            return self.weight @ self.weight

    model = nd.fully_shard(OnlyParam())
    out = model()
    out.sum().backward()
    return tuple(out.shape), model.weight.grad is not None


@case
def torch_test_layer_by_layer_shard_no_false_positive(rank):
    """Blocks sharded one by one with gc in between: no duplicate-parameter error from id reuse."""
    import gc

    import nccl_ddp as nd

    blocks = torch.nn.ModuleList()
    for _ in range(6):
        block = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16, bias=False))
        blocks.append(block)
        nd.fully_shard(block)
        gc.collect()
    model = nd.fully_shard(torch.nn.Sequential(*blocks))
    model(torch.randn(2, 4, 16)).sum().backward()
    return all(p.grad is not None for p in model.parameters())


@case
def torch_test_group_instead_of_mesh(rank):
    """Not torch's: our group (or torch's world group) given as group= instead of a mesh."""
    import torch.distributed as dist

    import nccl_ddp as nd

    nd.fully_shard(_mlp(4))  # our world is up from here on
    out = {}
    for name, kw in (
        ("mesh", {}),
        ("ours", {"group": nd.get_world_group()}),
        ("torch", {"group": dist.group.WORLD}),
    ):
        model = nd.fully_shard(_mlp(4), **kw)
        g = torch.Generator().manual_seed(rank)
        data = [[torch.randn(2, 4, generator=g)] for _ in range(3)]
        out[name] = train(model, torch.optim.SGD(model.parameters(), lr=0.1), data)["losses"]
    return out


@case
def torch_test_fsdp_class_and_methods(rank):
    """The module's class becomes FSDP<cls>, an nccl_ddp and a torch FSDPModule."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    import nccl_ddp as nd

    model = nd.fully_shard(_mlp(4))
    return type(model).__name__, isinstance(model, nd.FSDPModule), isinstance(model, TorchFSDPModule)


def _features(rank: int, world: int, store_dir: str) -> dict:
    with gloo(rank, world, store_dir):
        return {name: outcome(lambda fn=fn: fn(rank)) for name, fn in CASES.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    return run_ranks(_features, 2, str(tmp_path_factory.mktemp("fsdp-features")), timeout=600)


def _ok(ranks, name) -> list:
    for rank, res in enumerate(ranks):
        assert res[name][0] == "ok", f"rank {rank}: {res[name]}"
    return [res[name][1] for res in ranks]


def _equal_to_torch(got: dict) -> None:
    ref, ours = got["torch"], got["ours"]
    for key in ("losses", "norms"):
        if key in ref:
            assert ours[key] == ref[key], key
    for name, value in ref.get("params", {}).items():
        np.testing.assert_array_equal(ours["params"][name], value, err_msg=name)


pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]


def test_registration_after_forward(ranks):
    for seen in _ok(ranks, "test_param_registration_after_forward"):
        assert seen["True"] == (True, [True] * 8, True, True)
        assert seen["False"] == (True, [False] * 8, True, True)
        # None: FSDP2's rule, the non-roots (model[0]'s) reshard, the root (model[1]'s) keeps
        assert seen["None"] == (True, [True] * 4 + [False] * 4, True, True)


def test_registration_after_backward(ranks):
    assert _ok(ranks, "test_param_registration_after_backward") == [(True, True)] * 2


@pytest.mark.parametrize(
    "name",
    [
        "test_multi_forward_module",
        "test_explicit_prefetching",
        "test_clip_grad_norm_on_sharded_grads",
        "test_mixed_precision_bf16_params_fp32_reduce",
        "test_1f1b_microbatching",
        "test_train_parity_single_group_shard_dim0",
        "test_train_parity_with_shared_params",
        "test_gradient_accumulation",
    ],
)
def test_equal_to_torch_fully_shard(ranks, name):
    """Losses (and clipped norms) and the trained parameters, bit for bit (per setting where
    the case runs several)."""
    for got in _ok(ranks, name):
        for setting in [got] if "torch" in got else got.values():
            _equal_to_torch(setting)


def test_non_root_then_root(ranks):
    for got in _ok(ranks, "test_non_root_forward_backward"):
        assert got["ours"] == got["torch"]


def test_uneven_tied_rows_all_train(ranks):
    got = _ok(ranks, "test_train_shared_params_uneven_shard")
    assert [g[1] for g in got] == [5, 4]  # 9 rows: 5 + 4
    assert all(all(g[0]) for g in got)


def test_group_instead_of_mesh(ranks):
    for got in _ok(ranks, "test_group_instead_of_mesh"):
        assert got["ours"] == got["mesh"] == got["torch"]


def test_root_without_inputs_and_layer_by_layer(ranks):
    assert _ok(ranks, "test_root_no_forward_inputs") == [((4, 4), True)] * 2
    assert _ok(ranks, "test_layer_by_layer_shard_no_false_positive") == [True, True]
    assert _ok(ranks, "test_fsdp_class_and_methods") == [("FSDPMLP", True, True)] * 2


def test_every_torch_training_test_is_answered_or_says_why():
    from fsdp_torch_tests import TORCH_TESTS

    answered = {n for n, why in TORCH_TESTS.items() if why.startswith("case")}
    assert answered <= set(CASES), sorted(answered - set(CASES))
    assert all(why for why in TORCH_TESTS.values())
    assert len(TORCH_TESTS) == 39
