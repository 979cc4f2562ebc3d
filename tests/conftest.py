import pytest


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found by CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
