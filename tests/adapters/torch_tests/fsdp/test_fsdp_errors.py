"""fully_shard's bad inputs, 2 ranks: each raises on every rank, before any data moves, naming
the rank, the parameter and what to do (a unit applied twice, a parameter shared with another
unit, shapes that differ across ranks, a meta parameter never materialised (at the first
forward), a non-contiguous one, a cast after fully_shard to dtypes that differ across ranks or
with grads, our DDP over a sharded model)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
pytest.importorskip("expecttest", reason="torch's test helpers need expecttest (the test extra)")

from fsdp_cases import gloo, tied  # noqa: E402
from mp import outcome, run_ranks  # noqa: E402


def _mlp(dim: int = 4):
    from torch.testing._internal.common_fsdp import MLP

    torch.manual_seed(42)
    return MLP(dim)


def _errors(rank: int, world: int, store_dir: str) -> dict:
    """What each bad input raises, on every rank, before any data moves."""
    import nccl_ddp as nd

    def twice():
        m = _mlp(4)
        nd.fully_shard(m)
        nd.fully_shard(m)

    def shared_across_units():
        m = tied(17)
        nd.fully_shard(m.tok_embeddings)
        nd.fully_shard(m.output)

    def shapes_differ():
        nd.fully_shard(torch.nn.Linear(4, 4 + rank))

    def meta_never_materialised():  # sharded on meta (FSDP2's deferred init), no to_empty
        with torch.device("meta"):
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        nd.fully_shard(m[0])
        nd.fully_shard(m)
        m(torch.ones(2, 4))

    def not_contiguous():
        m = torch.nn.Linear(4, 6)
        m.weight = torch.nn.Parameter(torch.randn(4, 6).t())
        nd.fully_shard(m)

    def no_dimensions():
        m = torch.nn.Linear(4, 4)
        m.scale = torch.nn.Parameter(torch.tensor(1.0))
        nd.fully_shard(m)

    def cast_differs_across_ranks():  # refused before anything moves: still float32 after
        m = _mlp(4)
        nd.fully_shard(m.in_proj)
        nd.fully_shard(m)
        try:
            m.to(torch.float64 if rank == 0 else torch.float16)
        finally:
            assert {p.dtype for p in m.parameters()} == {torch.float32}

    def cast_with_grads():
        m = _mlp(4)
        nd.fully_shard(m)
        m(torch.ones(2, 4)).sum().backward()
        m.to(torch.float64)

    def ddp_over_fully_shard():  # HSDP is the 2-D mesh's, not our DDP's over the shards
        m = _mlp(4)
        nd.fully_shard(m.in_proj)
        nd.fully_shard(m)
        nd.DistributedDataParallel(m)

    cases = (twice, shared_across_units, shapes_differ, meta_never_materialised, not_contiguous)
    cases += (no_dimensions, cast_differs_across_ranks, cast_with_grads, ddp_over_fully_shard)
    with gloo(rank, world, store_dir):
        return {f.__name__: outcome(f) for f in cases}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    return run_ranks(_errors, 2, str(tmp_path_factory.mktemp("fsdp-errors")), timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "case,error,words",
    [
        ("twice", "ConfigError", ["applied twice", "once per module"]),
        ("shared_across_units", "ConfigError", ["'weight'", "already manages it", "one unit"]),
        ("shapes_differ", "RankMismatchError", ["'weight'", "rank 1 has shape (5, 4)"]),
        ("meta_never_materialised", "ConfigError", ["'1.weight'", "meta device", "to_empty(device='cpu')"]),
        ("not_contiguous", "ConfigError", ["'weight'", "not contiguous", "contiguous()"]),
        ("no_dimensions", "ConfigError", ["'scale'", "no dimensions", "shape (1,)"]),
        ("cast_differs_across_ranks", "RankMismatchError", ["'out_proj.weight'", "float64", "float16"]),
        ("cast_with_grads", "ConfigError", ["has grads", "zero_grad(set_to_none=True)"]),
        ("ddp_over_fully_shard", "ConfigError", ["FSDPMLP at the root", "2-D mesh", "replicate group"]),
    ],
)
def test_errors_named_on_every_rank(ranks, case, error, words):
    for rank, res in enumerate(ranks):
        kind, msg = res[case]
        assert kind == error, (rank, kind, msg)
        assert f"rank {rank}" in msg
        for w in words:
            assert w in msg, (w, msg)
