"""Checks of the Paddle adapter, run in the Paddle venv by tests/adapters/paddle_tests/test_paddle_adapter.py.

    python paddle_checks.py train OUT     # under nccl-ddp-run with 2 ranks
    python paddle_checks.py single        # one process (a job of one)
    python paddle_checks.py no_finalize OUT   # under nccl-ddp-run with 2 ranks

train: every rank joins our job and Paddle's own (gloo on the CPU: Paddle's environment
variables, its store on a port rank 0 picked and broadcast through ours), then trains the same
model from the same seeds three ways: our DistributedDataParallel, our DistributedGradReducer on
Paddle's grads, and `paddle.DataParallel` (the oracle). Steps 2 and 3 run under no_sync(), step 4
reduces what they accumulated. The model starts from a different seed and BatchNorm statistics on
each rank: both DDPs broadcast rank 0's. After training, one evaluation forward. Then
find_unused_parameters=True, ours against Paddle's, on a two-headed model. Writes
OUT/rank{r}.npz (every parameter and BatchNorm statistic of each run, and rank 0's initial ones)
and OUT/rank{r}.json (state_dict keys and parameter names of both wrappers).

single: bad inputs, each named by parameter; errors raised inside backward; a tied parameter and
accumulation across backward calls; find_unused_parameters;
dtypes read from Paddle. Prints "paddle_checks: all passed" or raises.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

warnings.filterwarnings("ignore", message="No ccache found")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import nccl_ddp as nd  # noqa: E402
from nccl_ddp.errors import ConfigError, ConfigTypeError, ReducerError  # noqa: E402

STEPS = 6
NO_SYNC_STEPS = (2, 3)


def build(seed: int, stats: float = 0.0) -> paddle.nn.Layer:
    """The model from `seed`; `stats` is added to BatchNorm's running mean (a rank's own)."""
    paddle.seed(seed)
    model = paddle.nn.Sequential(
        paddle.nn.Linear(16, 32),
        paddle.nn.BatchNorm1D(32),
        paddle.nn.ReLU(),
        paddle.nn.Linear(32, 4),
    )
    model[1]._mean.set_value(model[1]._mean + stats)
    return model


class Branches(paddle.nn.Layer):
    """Two heads; a step uses one of them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = paddle.nn.Linear(16, 8), paddle.nn.Linear(8, 2), paddle.nn.Linear(8, 2)

    def forward(self, x, use_c=False):
        h = self.a(x)
        return self.c(h) if use_c else self.b(h)


class Tied(paddle.nn.Layer):
    """One Linear applied twice."""

    def __init__(self):
        super().__init__()
        self.l = paddle.nn.Linear(16, 16)

    def forward(self, x):
        return self.l(self.l(x))


def batch(rank: int, step: int) -> tuple:
    rs = np.random.RandomState(1000 * rank + step)
    return paddle.to_tensor(rs.randn(8, 16).astype(np.float32)), paddle.to_tensor(
        rs.randn(8, 4).astype(np.float32)
    )


def init_paddle_gloo(rank: int, world: int) -> None:
    """Paddle's process group over gloo, beside ours: rank 0 picks a free port for Paddle's store
    and sends it through our broadcast; MASTER_ADDR/MASTER_PORT (our launcher's) are hidden
    from Paddle, which would start its store there."""
    port = np.zeros(1, np.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    nd.broadcast(port, 0)
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    eps = [f"127.0.0.1:{int(port[0]) + 1 + r}" for r in range(world)]
    os.environ.update(
        PADDLE_DISTRI_BACKEND="gloo",
        PADDLE_TRAINER_ID=str(rank),
        PADDLE_TRAINERS_NUM=str(world),
        PADDLE_MASTER=f"127.0.0.1:{int(port[0])}",
        PADDLE_TRAINER_ENDPOINTS=",".join(eps),
        PADDLE_CURRENT_ENDPOINT=eps[rank],
    )
    paddle.distributed.init_parallel_env()


def train_step(model, opt, rank: int, step: int, reducer=None) -> None:
    x, y = batch(rank, step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if step in NO_SYNC_STEPS:
        return  # grads accumulate into the next step's
    if reducer is not None:
        params = [p for p in model.parameters() if p.trainable]
        for p, g in zip(params, reducer([p.grad for p in params])):
            p.grad = g
    opt.step()
    opt.clear_grad()


def state(model, prefix: str) -> dict:
    return {f"{prefix}/{k}": v.numpy() for k, v in model.state_dict().items()}


# which head each rank uses per step: both used by one rank each, then the other way, then c unused
# by every rank
HEADS = ((False, True), (True, False), (False, False))


def unused_parameters(rank: int) -> dict:
    """find_unused_parameters=True, ours (finalize() after backward) and Paddle's, on a model
    whose ranks use different heads: the parameters of both after 3 Momentum steps."""
    out = {}
    for name, wrap in (
        ("unused_ours", lambda m: nd.DistributedDataParallel(m, find_unused_parameters=True)),
        ("unused_paddle", lambda m: paddle.DataParallel(m, find_unused_parameters=True)),
    ):
        paddle.seed(7)
        model = wrap(Branches())
        opt = paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=model.parameters())
        for step, heads in enumerate(HEADS):
            x, _ = batch(rank, step)
            (model(x, use_c=heads[rank]) ** 2).mean().backward()
            if name == "unused_ours":
                model.finalize()
            opt.step()
            opt.clear_grad()
        out.update(state(model, name))
    return out


def train(out: str) -> None:
    nd.init_process_group()
    rank, world = nd.get_rank(), nd.get_world_size()
    init_paddle_gloo(rank, world)

    ours = nd.DistributedDataParallel(build(100 + rank, stats=rank))
    theirs = paddle.DataParallel(build(100 + rank, stats=rank))
    plain = build(100)  # the grad reducer does not broadcast: rank 0's seed everywhere
    reducer = nd.DistributedGradReducer([p for p in plain.parameters() if p.trainable])
    assert isinstance(ours, paddle.nn.Layer) and type(ours).__name__ == "PaddleDistributedDataParallel"

    opts = {
        name: paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=m.parameters())
        for name, m in (("ours", ours), ("paddle", theirs), ("reducer", plain))
    }
    for step in range(STEPS):
        for name, model in (("ours", ours), ("paddle", theirs)):
            if step in NO_SYNC_STEPS:
                with model.no_sync():
                    train_step(model, opts[name], rank, step)
            else:
                train_step(model, opts[name], rank, step)
        train_step(plain, opts["reducer"], rank, step, reducer=reducer)
    # an evaluation forward after training: ours gives every rank rank 0's BatchNorm statistics
    # first (torch's broadcast_buffers), Paddle's keeps each rank's own
    x, _ = batch(rank, STEPS)
    for model in (ours, theirs):
        model.eval()
        with paddle.no_grad():
            model(x)

    arrays = {
        **unused_parameters(rank),
        **state(ours, "ours"),
        **state(theirs, "paddle"),
        **state(plain, "reducer"),
        **state(build(100), "init"),
    }
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    names = {
        "ours_state_dict": list(ours.state_dict()),
        "paddle_state_dict": list(theirs.state_dict()),
        "ours_named_parameters": [n for n, _ in ours.named_parameters()],
        "paddle_named_parameters": [n for n, _ in theirs.named_parameters()],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(names, f)
    ours.close()
    reducer.close()
    nd.destroy_process_group()
    print(f"paddle_checks: rank {rank} trained {STEPS} steps", flush=True)


def expect(error: type, *fragments: str):
    """A context manager: the block raises `error` with every fragment in its message."""

    class _Expect:
        def __enter__(self):
            return self

        def __exit__(self, typ, value, tb):
            if typ is None:
                raise AssertionError(f"expected {error.__name__} mentioning {fragments}")
            if not issubclass(typ, error):
                return False
            missing = [f for f in fragments if f not in str(value)]
            if missing:
                raise AssertionError(f"{typ.__name__} {value!s} lacks {missing}")
            return True

    return _Expect()


def single() -> None:
    nd.init_process_group()
    model = build(1)
    params = [p for p in model.parameters() if p.trainable]
    reducer = nd.DistributedGradReducer(params)
    x, y = batch(0, 0)
    ((model(x) - y) ** 2).mean().backward()
    grads = [p.grad for p in params]

    # a job of one: the reduced grads are Paddle tensors equal to the input ones
    reduced = reducer(grads)
    assert isinstance(reduced, list) and all(isinstance(g, paddle.Tensor) for g in reduced)
    for g, r in zip(grads, reduced):
        np.testing.assert_array_equal(g.numpy(), r.numpy())
    assert isinstance(reducer(tuple(grads)), tuple)

    # mixed frameworks: a NumPy grad, a NumPy parameter
    with expect(ConfigTypeError, "grads[1]", "numpy.ndarray", "paddle parameters"):
        reducer([grads[0], grads[1].numpy()] + grads[2:])
    with expect(ConfigTypeError, "parameters[1]", "numpy.ndarray"):
        nd.DistributedGradReducer([params[0], np.zeros(3, np.float32)])
    # dtypes and shapes, named by parameter
    with expect(ConfigError, "grads[0]", "'linear_0.w_0'", "float64", "float32"):
        reducer([grads[0].astype("float64")] + grads[1:])
    with expect(ConfigError, "grads[2]", "(32,)"):
        reducer(grads[:2] + [paddle.zeros([31])] + grads[3:])
    with expect(ConfigError, "5 grads for 6 parameters"):
        reducer(grads[:-1])

    # DDP: paddle.DataParallel's options we cannot honour, by name
    with expect(ConfigError, "group must be None"):
        nd.DistributedDataParallel(build(1), group=object())
    with expect(ConfigError, "last_comm_buffer_size"):
        nd.DistributedDataParallel(build(1), last_comm_buffer_size=2)
    with expect(ConfigError, "strategy"):
        nd.DistributedDataParallel(build(1), strategy=object())
    # a grad given by hand that does not fit its parameter
    ddp = nd.DistributedDataParallel(build(1))
    loss = ((ddp(x) - y) ** 2).mean()
    # Paddle 1.x's calls, no-ops in Paddle's own since 2.0, are no-ops here too
    assert ddp.scale_loss(loss) is loss and ddp.apply_collective_grads() is None
    ddp.zero_grad()
    ddp(x)
    with expect(ConfigError, "parameter 0", "'0.weight'", "(16, 32)"):
        ddp.mark_ready(0, paddle.zeros([16, 31]))
    with expect(ConfigTypeError, "'0.bias'", "float64"):
        ddp.mark_ready("0.bias", paddle.zeros([32], dtype="float64"))
    ddp.close()

    # an error inside backward (a second backward without a forward): Paddle raises SystemError,
    # ours at the end of its context chain (first in the traceback)
    ddp = nd.DistributedDataParallel(build(1))
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        raise AssertionError("a second backward without forward passed")
    except SystemError as e:
        chain = []
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        assert isinstance(chain[-1], ReducerError), chain
        assert "marked ready after the step was finalized" in str(chain[-1]), chain[-1]
    ddp.close()

    # a parameter used twice in a forward is marked ready once per backward; grads accumulate
    # across backward calls until clear_grad(), as a bare Paddle layer's (a job of one: equal)
    paddle.seed(3)
    tied, bare = Tied(), Tied()
    bare.set_state_dict(tied.state_dict())
    ddp = nd.DistributedDataParallel(tied)
    for _ in range(2):
        ddp(x).sum().backward()
        bare(x).sum().backward()
    np.testing.assert_array_equal(tied.l.weight.grad.numpy(), bare.l.weight.grad.numpy())
    ddp.close()

    # find_unused_parameters: a branch unused in this step keeps Paddle's grad (None); finalize()
    # ends the step
    net = Branches()
    ddp = nd.DistributedDataParallel(net, find_unused_parameters=True)
    ddp(x).sum().backward()
    ddp.finalize()
    assert net.c.weight.grad is None and net.b.weight.grad is not None
    want = net.b.weight.grad.numpy().copy()
    ddp(x, use_c=True).sum().backward()
    ddp.finalize()
    np.testing.assert_array_equal(net.b.weight.grad.numpy(), want)  # Paddle's, kept
    assert net.c.weight.grad is not None
    ddp.close()

    # the functional collectives: a Paddle tensor is reduced in place and comes back itself
    t = paddle.full([3], 2.0)
    assert nd.all_reduce(t) is t
    np.testing.assert_array_equal(t.numpy(), np.full(3, 2.0, np.float32))

    # dtypes read from Paddle: float16 / float64 / bfloat16 parameters keep their dtype
    for dtype in ("float16", "float64", "bfloat16"):
        t = paddle.zeros([3], dtype=dtype)
        red = nd.DistributedGradReducer([t])
        (out,) = red([paddle.full([3], 1.5, dtype=dtype)])
        assert out.dtype == t.dtype, (out.dtype, t.dtype)
        np.testing.assert_array_equal(out.astype("float32").numpy(), np.full(3, 1.5, np.float32))
        red.close()
    reducer.close()
    nd.destroy_process_group()
    print("paddle_checks: all passed", flush=True)


def no_finalize(out: str) -> None:
    """find_unused_parameters=True, the ranks using different heads, and no finalize(): the next
    forward refuses, and the message says to call finalize(). Writes OUT/nofinalize{r}.txt."""
    nd.init_process_group(timeout=30)
    rank = nd.get_rank()
    model = nd.DistributedDataParallel(Branches(), find_unused_parameters=True)
    opt = paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=model.parameters())
    got = "no error"
    try:
        for step, heads in enumerate(HEADS):
            x, _ = batch(rank, step)
            (model(x, use_c=heads[rank]) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
    except Exception as e:  # the test reads it
        got = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"nofinalize{rank}.txt"), "w") as f:
        f.write(got)
    nd.destroy_process_group()
    print(f"paddle_checks: rank {rank} no_finalize", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    elif sys.argv[1] == "no_finalize":
        no_finalize(sys.argv[2])
    else:
        single()
