"""pytest plugin of scripts/gpu_check.sh: the GPU tests that matter most run first (the kernels bit
for bit, torch on CUDA streams, DDP on the GPU, NCCL, fully_shard on the GPU; bfloat16 cases
first within each file), so a short GPU session sees their results even if the step runs out of
time."""

FIRST = (
    "test_kernels_gpu.py",
    "test_torch_adapter.py",
    "test_ddp_gpu.py",
    "test_nccl_backend.py",
    "test_fsdp_gpu.py",
)


def _rank(item):
    name = item.path.name
    bf16 = "bf16" in item.name or "bfloat16" in item.name
    return (FIRST.index(name) if name in FIRST else len(FIRST), not bf16)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_rank)  # stable: the files' own order otherwise
