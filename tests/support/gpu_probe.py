"""Whether this machine has a CUDA GPU CuPy can use (conftest skips `gpu` tests without one)."""


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()
