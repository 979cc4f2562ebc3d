"""Where fully_shard's parameters may live, checked before any data moves: one device per unit,
CPU parameters on the host backend, CUDA ones on the nccl backend (its GPU: the GPU path), any
other device refused by name. Run with stand-ins for the parameters and groups (no GPU here)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

from nccl_ddp.adapters.torch.fsdp import placement  # noqa: E402
from nccl_ddp.device import HostDevice  # noqa: E402
from nccl_ddp.errors import ConfigError  # noqa: E402


def _found(*devices):
    return [
        (f"layer{i}.weight", [], SimpleNamespace(device=torch.device(d), is_meta=d == "meta"))
        for i, d in enumerate(devices)
    ]


def _group(backend):
    return SimpleNamespace(backend=backend, name="world")


def test_one_device_per_unit():
    assert placement.param_device(_found("cpu", "cpu"), 0) == torch.device("cpu")
    assert placement.param_device(_found("cuda:1", "cuda:1"), 0) == torch.device("cuda", 1)
    assert placement.param_device([], 0) == torch.device("cpu")
    assert placement.param_device(_found("meta", "cpu"), 0) == torch.device("cpu")  # to_empty(device="cpu")
    with pytest.raises(ConfigError, match=r"rank 3: .*several devices.*'layer1.weight' on cuda:0"):
        placement.param_device(_found("cpu", "cuda:0"), 3)


def test_a_device_without_a_backend_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"rank 1: parameter 'layer0.weight' is on mps.*CUDA tensors"):
        placement.param_device(_found("mps"), 1)


def test_cpu_parameters_take_the_host_path_and_not_a_nccl_group():
    assert isinstance(placement.device_for(torch.device("cpu"), _group("host"), 0), HostDevice)
    with pytest.raises(ConfigError, match=r"rank 2: .*CPU parameters.*nccl backend.*module.cuda"):
        placement.device_for(torch.device("cpu"), _group("nccl"), 2)


def test_cuda_parameters_need_the_nccl_backend():
    with pytest.raises(ConfigError, match=r"rank 0: .*on cuda:0.*'host' backend.*'nccl'"):
        placement.device_for(torch.device("cuda", 0), _group("host"), 0)


def test_the_compute_stream_waits_on_cuda_and_the_host_thread_blocks_on_the_host(monkeypatch):
    """A unit's wait for its gather (and the end of backward's for the reduce-scatters): on CUDA
    queued on the compute stream (CuPy's current one: torch's under the hooks), the host not
    blocked; on the host backend the calling thread blocks, up to the group's timeout."""
    import _fake_cupy
    from kernel_checks import fake_cupy_installed

    from nccl_ddp.adapters.torch.fsdp.unit import Schedule
    from nccl_ddp.device import CudaDevice, HostEvent
    from nccl_ddp.errors import CommTimeout

    fake_cupy_installed(monkeypatch)
    group = SimpleNamespace(timeout=0.2, zeros=lambda device, n, dt: device.zeros(n, dt))
    cuda = Schedule(group, CudaDevice(0), None)
    event = cuda.comm.record()  # never reached on the fake GPU unless told
    cuda.compute_waits(event)  # returns at once
    assert _fake_cupy.FAKE_STATE["current"].waited == [event.event]
    host = Schedule(group, HostDevice(), None)
    try:
        with pytest.raises(CommTimeout, match="0.2s"):
            host.compute_waits(HostEvent())
    finally:
        host.close()
