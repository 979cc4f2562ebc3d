"""torch's own comm hooks and torch's Join on our torch DDP wrapper, held to torch DDP (gloo) in the
same two processes: `register_comm_hook` with torch's `allreduce_hook`, `fp16_compress_hook`,
`powerSGD_hook` and a user's hook written for torch (torch.distributed collectives on the bucket's
torch tensor); `torch.distributed.algorithms.join.Join([model])` with uneven inputs. Also what
Lightning and Accelerate read from a torch DDP object.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import run_ranks

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

STEPS = 5


def _model(rank: int):
    torch.manual_seed(100 + rank)  # different on every rank: DDP broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(rank: int, n: int) -> list:
    g = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _train(ddp, rank: int, n: int, join=None) -> dict:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ctx = join([ddp]) if join is not None else _null()
    with ctx:
        for x, y in _batches(rank, n):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in ddp.module.state_dict().items()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _user_hook(state, bucket):
    """A hook as a user writes it for torch: mean over torch's default group, in place."""
    import torch.distributed as dist

    t = bucket.buffer()
    assert isinstance(t, torch.Tensor) and t.dim() == 1
    grads = bucket.gradients()
    assert [tuple(g.shape) for g in grads] == [tuple(p.shape) for p in bucket.parameters()]
    assert all(g.data_ptr() >= t.data_ptr() for g in grads)  # views of the buffer
    assert all(isinstance(p, torch.nn.Parameter) for p in bucket.parameters())
    assert bucket.index() == 0 and bucket.is_last()
    t.div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def _hooks(rank: int, world: int, store_dir: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.algorithms.join import Joinable as TorchJoinable
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch_oracle import gloo_group

    import nccl_ddp as nd

    torch.set_num_threads(1)
    real_randn = psgd.torch.randn

    def fixed_randn(*shape, device=None, dtype=None, generator=None):
        """PowerSGD's random Q by shape only: the same for both DDPs whatever their bucket
        order."""
        n = int(np.prod(shape))
        return torch.from_numpy(np.cos(np.arange(n) * 0.37 + 0.1).astype(np.float32)).reshape(shape).to(dtype)

    def powersgd():
        return psgd.PowerSGDState(
            None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=0.1,
            use_error_feedback=True,
            warm_start=True,
        )

    hooks = {
        "allreduce": lambda: (None, default_hooks.allreduce_hook),
        "fp16": lambda: (None, default_hooks.fp16_compress_hook),
        "powersgd": lambda: (powersgd(), psgd.powerSGD_hook),
        "user": lambda: (None, _user_hook),
    }
    out: dict = {}
    with gloo_group(rank, world, os.path.join(store_dir, "gloo")):
        nd.init_process_group("host")
        psgd.torch.randn = fixed_randn
        try:
            for name, make in hooks.items():
                runs = []
                for cls in (TorchDDP, nd.DistributedDataParallel):
                    ddp = cls(_model(rank))
                    ddp.register_comm_hook(*make())
                    runs.append(_train(ddp, rank, STEPS))
                out[name] = runs
            # torch's Join with uneven inputs (rank 0: 3 batches, rank 1: 5), then ours
            n = 3 + 2 * rank
            out["torch Join"] = [
                _train(TorchDDP(_model(rank)), rank, n, TorchJoin),
                _train(nd.DistributedDataParallel(_model(rank)), rank, n, TorchJoin),
            ]
            out["nd.Join"] = [
                out["torch Join"][0],
                _train(nd.DistributedDataParallel(_model(rank)), rank, n, nd.Join),
            ]
            ddp = nd.DistributedDataParallel(_model(rank))
            out["joinable"] = (isinstance(ddp, TorchJoinable), str(ddp.join_device))
            out["no torch group"] = _without_torch_dist(rank)
        finally:
            psgd.torch.randn = real_randn
            nd.destroy_process_group()
    return out


def _without_torch_dist(rank: int) -> list:
    """What registering torch's PowerSGD hook says, and which group join_process_group gives,
    when torch.distributed is not initialised (hidden for the call)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    import nccl_ddp as nd

    real = dist.is_initialized
    dist.is_initialized = lambda: False
    errors = []
    try:
        ddp = nd.DistributedDataParallel(_model(rank))
        try:
            ddp.register_comm_hook(psgd.PowerSGDState(None), psgd.powerSGD_hook)
        except nd.errors.ConfigError as e:
            errors.append(str(e))
        errors.append(ddp.join_process_group is ddp.process_group)  # ours, not torch's
    finally:
        dist.is_initialized = real
    return errors


@pytest.mark.slow
def test_torch_hooks_and_torch_join_match_torch_ddp(tmp_path):
    results = run_ranks(_hooks, 2, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        for name in ("allreduce", "fp16", "user", "torch Join", "nd.Join"):
            ref, ours = res[name]
            assert set(ref) == set(ours)
            for k in ref:
                np.testing.assert_array_equal(ours[k], ref[k], err_msg=f"rank {rank} {name} {k}")
        ref, ours = res["powersgd"]
        for k in ref:  # the same arithmetic but for the order of P/Q sums: float32 noise
            np.testing.assert_allclose(
                ours[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} powersgd {k}"
            )
        assert res["joinable"] == (True, "cpu")
        hook_error, join_group_is_ours = res["no torch group"]
        assert "torch.distributed" in hook_error and "nccl_ddp.hooks" in hook_error
        assert join_group_is_ours is True
    # the hooks changed something: fp16 and PowerSGD differ from the plain all-reduce
    r0 = results[0]
    w = next(iter(r0["allreduce"][1]))
    assert not np.array_equal(r0["fp16"][1][w], r0["allreduce"][1][w])
    assert not np.array_equal(r0["powersgd"][1][w], r0["allreduce"][1][w])
    # Join: both ranks end with the same parameters
    for k in r0["torch Join"][1]:
        np.testing.assert_array_equal(r0["torch Join"][1][k], results[1]["torch Join"][1][k])


def _attributes(rank: int, world: int) -> dict:
    import nccl_ddp as nd

    nd.init_process_group("host")
    try:
        ddp = nd.DistributedDataParallel(_model(rank), find_unused_parameters=True)
        out = {
            "static_graph": ddp.static_graph,
            "fup": ddp.find_unused_parameters,
            "logging": ddp._get_ddp_logging_data(),
        }
        # Accelerate's trigger_sync_in_backward: forward under no_sync, then sync the backward
        x, y = _batches(rank, 1)[0]
        with ddp.no_sync():
            assert ddp.require_backward_grad_sync is False
            loss = torch.nn.functional.mse_loss(ddp(x), y)
        ddp.require_backward_grad_sync = True
        ddp.reducer.prepare_for_backward([])
        assert ddp.reducer._rebuild_buckets() is False
        loss.backward()
        out["grad"] = ddp.module[0].weight.grad.numpy().copy()
        ddp.reducer._delay_all_reduce()
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.slow
def test_what_lightning_and_accelerate_read():
    r0, r1 = run_ranks(_attributes, 2, timeout=120)
    assert (r0["static_graph"], r0["fup"]) == (False, True)
    assert r0["logging"]["can_set_static_graph"] is False
    assert r0["logging"]["world_size"] == 2
    # prepare_for_backward turned the no_sync step into a synchronised one: grads agree
    np.testing.assert_array_equal(r0["grad"], r1["grad"])


@pytest.mark.slow
def test_torch_future_of_a_new_tensor_from_an_unhashable_hook():
    """A hook object (not hashable) written for torch that returns a completed torch Future of a
    new tensor: the value lands in the bucket and the grads (world of one: the local grads)."""
    import nccl_ddp as nd

    class Doubler:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, state, bucket):
            fut = torch.futures.Future()
            fut.set_result([bucket.buffer() * 2])  # a collective's future: a list of one
            return fut

    nd.init_process_group("host", rank=0, world_size=1)
    try:
        model = _model(0)
        ddp = nd.DistributedDataParallel(model)
        ddp.register_comm_hook(None, Doubler())
        x, y = _batches(0, 1)[0]
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ours = [p.grad.clone() for p in model.parameters()]
        ref = _model(0)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for o, p in zip(ours, ref.parameters()):
            torch.testing.assert_close(o, 2 * p.grad, rtol=0, atol=0)
        ddp.close()
    finally:
        nd.destroy_process_group()


def _cuda_hooks(rank: int, world: int) -> list:
    import nccl_ddp as nd

    def doubled_new_tensor(state, bucket):
        """torch work on the bucket's CUDA tensor (on torch's current stream, which the reducer
        makes its comm stream), a completed future of a new tensor."""
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    nd.init_process_group("nccl", timeout=60.0)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        out = []
        for step in range(3):
            model, ref = _model(0).to(dev), _model(0).to(dev)
            ddp = nd.DistributedDataParallel(model, device_ids=[dev.index])
            ddp.register_comm_hook(None, doubled_new_tensor)
            x, y = (t.to(dev) for t in _batches(step, 1)[0])
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            torch.cuda.synchronize()
            out.append(
                max(
                    float((p.grad - 2 * q.grad).abs().max())
                    for p, q in zip(model.parameters(), ref.parameters())
                )
            )
            ddp.close()
        return out
    finally:
        nd.destroy_process_group()


@pytest.mark.gpu
def test_torch_hook_on_cuda_buckets():
    """GPU only (not yet run on a GPU): a torch hook on CUDA bucket tensors, world of one: the
    grads are twice the local ones."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (the CPU wheel)")
    diffs = run_ranks(_cuda_hooks, 1, timeout=300)[0]
    assert max(diffs) <= 1e-6, diffs
