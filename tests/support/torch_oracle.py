"""The PyTorch reference our torch adapter is held to: a model, a training loop and torch's own DDP.

`TiedNet` has a tied weight (the input projection is reused, transposed, as the output layer), a
branch that is unused on some steps, and a buffer that differs per rank before DDP broadcasts it.
Its parameters also start different on every rank, so the init broadcast is exercised.
`train(model, config, rank)` runs the same loop around any DDP wrapper (torch's or ours): different
data per rank, `no_sync()` on all but the last micro-batch of a step, SGD with momentum and
`zero_grad()` (set_to_none, torch's default) after each step. `run_torch_ddp` is the oracle:
`torch.nn.parallel.DistributedDataParallel` on gloo.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

IN, HIDDEN = 8, 16


def assert_matches_torch(per_rank: list, name: str) -> None:
    """Case `name` of every rank's results (`results[name] = (torch DDP's state, ours)`): ours
    has the same keys and equals torch's to 1e-6."""
    for rank, results in enumerate(per_rank):
        reference, ours = results[name]
        assert set(ours) == set(reference)
        for key in reference:
            np.testing.assert_allclose(
                ours[key], reference[key], rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} {name}: {key}"
            )


@dataclass(frozen=True)
class OracleConfig:
    """One training scenario. `accumulate`: micro-batches per optimizer step (all but the last
    under no_sync). `static_graph`: the branch is never used (torch's static graph needs the same
    set of used parameters every step); otherwise it is used on even micro-batches only, or with
    `branch_by_rank` on even micro-batches on rank 0 and odd ones on rank 1 (then every step has
    a parameter unused on one rank and used on the other)."""

    steps: int = 4
    accumulate: int = 1
    static_graph: bool = False
    batch: int = 6
    lr: float = 0.05
    branch_by_rank: bool = False

    def uses_branch(self, micro: int, rank: int) -> bool:
        return (not self.static_graph) and (micro + (rank if self.branch_by_rank else 0)) % 2 == 0

    @property
    def find_unused_parameters(self) -> bool:
        return not self.static_graph


def make_model(rank: int):
    """A TiedNet whose parameters and buffer depend on `rank` (DDP must broadcast rank 0's)."""
    import torch

    class TiedNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(IN, HIDDEN, bias=False)  # weight (HIDDEN, IN), tied
            self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
            self.branch = torch.nn.Linear(HIDDEN, HIDDEN)
            self.register_buffer("scale", torch.full((HIDDEN,), 1.0 + 0.25 * rank))

        def forward(self, x, use_branch: bool = True):
            h = torch.tanh(self.embed(x)) * self.scale
            h = torch.tanh(self.hidden(h))
            if use_branch:
                h = h + torch.tanh(self.branch(h))
            return h @ self.embed.weight  # the tied output layer

    torch.manual_seed(1234 + rank)
    return TiedNet()


def batches(rank: int, config: OracleConfig):
    """(x, y) pairs, one per micro-batch; different on every rank, the same in every run."""
    import torch

    g = np.random.default_rng(100 + rank)
    n = config.steps * config.accumulate
    return [
        (
            torch.from_numpy(g.standard_normal((config.batch, IN), dtype=np.float32)),
            torch.from_numpy(g.standard_normal((config.batch, IN), dtype=np.float32)),
        )
        for _ in range(n)
    ]


def train(ddp_model, module, rank: int, config: OracleConfig, device: str = "cpu") -> dict:
    """Train `ddp_model` (wrapping `module`); returns {name: ndarray} of parameters and buffers."""
    import torch

    opt = torch.optim.SGD(module.parameters(), lr=config.lr, momentum=0.9)
    data = iter(batches(rank, config))
    micro = 0
    for _ in range(config.steps):
        for k in range(config.accumulate):
            x, y = (t.to(device) for t in next(data))
            last = k == config.accumulate - 1
            ctx = contextlib.nullcontext() if last else ddp_model.no_sync()
            with ctx:
                out = ddp_model(x, use_branch=config.uses_branch(micro, rank))
                loss = torch.nn.functional.mse_loss(out, y)
                loss.backward()
            micro += 1
        opt.step()
        opt.zero_grad()
    state = {n: t.detach().cpu().numpy().copy() for n, t in module.named_parameters()}
    state.update({n: t.detach().cpu().numpy().copy() for n, t in module.named_buffers()})
    return state


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, store_file: str):
    """torch.distributed on gloo for the block (rendezvous through `store_file`, so MASTER_PORT
    stays free for ours). One per process: re-initialising it per scenario hung now and then."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_torch_ddp(rank: int, config: OracleConfig) -> dict:
    """Train with torch DDP (inside `gloo_group`); returns the final parameters and buffers."""
    from torch.nn.parallel import DistributedDataParallel

    module = make_model(rank)
    # torch's static_graph=True crashes when the first backward runs under no_sync() and, once
    # past that, stops all-reducing (pytorch/pytorch#143580, #187732). static_graph changes
    # only scheduling, not the result, so with accumulation the oracle runs without it.
    static = config.static_graph and config.accumulate == 1
    ddp = DistributedDataParallel(module, find_unused_parameters=not static, static_graph=static)
    return train(ddp, module, rank, config)


# ---------------------------------------------------------------------------------------------
# The drop-in oracle: real training code's models and loops, torch DDP against ours.

CLASSES = 4


def make_bn_cnn(rank: int):
    """Conv + BatchNorm (running statistics and num_batches_tracked are buffers) + a head."""
    import torch
    from torch import nn

    torch.manual_seed(2000 + rank)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(24, CLASSES),
    )


def make_frozen_backbone(rank: int):
    """A fine-tune: a frozen backbone (requires_grad=False, different on every rank until DDP
    broadcasts it) with a BatchNorm, and a trainable head."""
    import torch
    from torch import nn

    torch.manual_seed(3000 + rank)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.BatchNorm1d(HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )
    for layer in list(model)[:4]:
        layer.requires_grad_(False)
    return model


def make_tied(rank: int):
    """TiedNet with its branch always used (the tied weight gets two grads per backward)."""
    import torch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(rank)

        def forward(self, x):
            return self.net(x, use_branch=True)[:, :CLASSES]

    return Tied()


def make_channels_last(rank: int):
    """The BatchNorm CNN in channels_last memory format: its conv weight is a non-contiguous
    Parameter."""
    import torch

    return make_bn_cnn(rank).to(memory_format=torch.channels_last)


def make_cnn_class(rank: int):
    """The BatchNorm CNN inside a model class of the user's own (torch.compile compiles frames of
    user code; torch's own nn.Sequential.forward alone is left to eager mode)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = make_bn_cnn(rank)

        def forward(self, x):
            return self.features(x)

    return Net()


MODELS = {
    "bn_cnn": make_bn_cnn,
    "cnn_class": make_cnn_class,
    "frozen_backbone": make_frozen_backbone,
    "tied": make_tied,
    "channels_last": make_channels_last,
}


@dataclass(frozen=True)
class Scenario:
    """A training loop: `accumulate` micro-batches per optimizer step (all but the last under
    no_sync()), SGD with momentum or AdamW with two parameter groups, optional gradient clipping
    and bf16 autocast, and an evaluation forward under torch.no_grad() after every step."""

    model: str
    steps: int = 4
    accumulate: int = 1
    optimizer: str = "sgd"
    clip: float = 0.0
    bf16_autocast: bool = False
    batch: int = 6


def scenario_batches(rank: int, scenario: Scenario):
    import torch

    g = np.random.default_rng(500 + rank)
    images = scenario.model in ("bn_cnn", "cnn_class", "channels_last")
    shape = (scenario.batch, 3, 6, 6) if images else (scenario.batch, IN)
    n = scenario.steps * scenario.accumulate + 1
    return [
        (
            torch.from_numpy(g.standard_normal(shape, dtype=np.float32)),
            torch.from_numpy(g.integers(0, CLASSES, scenario.batch)),
        )
        for _ in range(n)
    ]


def _optimizer(module, scenario: Scenario):
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    if scenario.optimizer == "adamw":
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}], lr=0.01
        )
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_scenario(ddp_model, module, rank: int, scenario: Scenario) -> dict:
    """Train `ddp_model` (wrapping `module`); returns {name: ndarray} of parameters and buffers."""
    import torch

    opt = _optimizer(module, scenario)
    data = iter(scenario_batches(rank, scenario))
    for _ in range(scenario.steps):
        for k in range(scenario.accumulate):
            x, y = next(data)
            last = k == scenario.accumulate - 1
            sync = contextlib.nullcontext() if last else ddp_model.no_sync()
            cast = (
                torch.autocast("cpu", dtype=torch.bfloat16)
                if scenario.bf16_autocast
                else contextlib.nullcontext()
            )
            with sync:
                with cast:
                    loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
                loss.backward()
        if scenario.clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), scenario.clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation forward between steps
            ddp_model(next(iter(scenario_batches(rank, scenario)))[0])
    state = {n: t.detach().cpu().numpy().copy() for n, t in module.named_parameters()}
    state.update({n: t.detach().cpu().numpy().copy() for n, t in module.named_buffers()})
    return state


def run_torch_scenario(rank: int, scenario: Scenario) -> dict:
    """The oracle: torch's DistributedDataParallel on gloo (inside `gloo_group`)."""
    from torch.nn.parallel import DistributedDataParallel

    module = MODELS[scenario.model](rank)
    return train_scenario(DistributedDataParallel(module), module, rank, scenario)
