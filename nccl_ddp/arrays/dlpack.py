"""Framework arrays <-> the backend's native arrays (NumPy on "host", CuPy on "cuda"), via DLPack:
the one module that speaks DLPack for the functional API and the framework adapters.

Writable inputs become zero-copy views, so a collective writes into the caller's own object.
Read-only or immutable inputs (JAX, TensorFlow, any read-only DLPack export) are copied, and
`from_native` hands back a new array of the caller's framework: through its adapter, or for a
framework without one through its own `from_dlpack` (`nccl_ddp.adapters.generic`). Framework dtypes
(`tf.float32`, `paddle.float32`, names) become NumPy's in `numpy_dtype`. Frameworks are imported
only when such an array shows up.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import numpy as np

from nccl_ddp.arrays import frameworks
from nccl_ddp.arrays.frameworks import is_immutable
from nccl_ddp.errors import ConfigError, ConfigTypeError

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {
    1: "cpu",
    2: "cuda",
    3: "cuda-host",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    10: "rocm",
    13: "cuda-managed",
}


def _dlpack_source(x: Any, where: str) -> Any:
    if not hasattr(x, "__dlpack__"):
        name = frameworks.framework_of(x)
        source = None if name is None else frameworks.adapter(name).dlpack_source(x)
        if source is not None:  # TensorFlow: its own export function, not the protocol
            return source
        raise ConfigTypeError(cannot_exchange(x, where))
    if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
        return x.detach()  # torch: same storage, no autograd tracking
    return x


def cannot_exchange(x: Any, where: str) -> str:
    """Why `x` cannot go through DLPack, and the ways out."""
    what = f"{type(x).__module__}.{type(x).__name__}"
    root = type(x).__module__.split(".")[0]
    if root == "builtins":
        return f"{where}: expected an array that supports DLPack (NumPy, CuPy, torch, JAX, ...), got {what}"
    numpy = "x.numpy()" if hasattr(x, "numpy") else "numpy.asarray(x)"
    return (
        f"{where}: expected an array that supports DLPack, got {what}: {root} arrays have no "
        f"__dlpack__, and nccl_ddp exchanges arrays through DLPack. Pass their values as NumPy "
        f"arrays ({numpy}) and copy the result back, or use a framework that speaks DLPack "
        f"(NumPy, CuPy, torch, JAX, TensorFlow, MindSpore, or any whose module has from_dlpack)"
    )


def _device_type(x: Any) -> int:
    try:
        return int(x.__dlpack_device__()[0])
    except (AttributeError, TypeError):
        return KDL_CPU
    except ValueError as e:  # torch's meta / sparse tensors have no DLPack device
        raise ConfigError(
            f"cannot exchange a {type(x).__name__} through DLPack ({e}); pass a dense CPU or GPU array"
        ) from e


def to_native(x: Any, device_kind: str, where: str = "collective") -> Any:
    """A native array for `x`: the same memory when `x` is writable, else a private copy.

    `device_kind` is "host" (NumPy) or "cuda" (CuPy); `where` prefixes error messages.
    """
    if device_kind == "host":
        return _to_numpy(x, where)
    if device_kind == "cuda":
        return _to_cupy(x, where)
    raise ConfigError(f"{where}: unknown device kind {device_kind!r}; use 'host' or 'cuda'")


def _to_numpy(x: Any, where: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x if x.flags.writeable else x.copy()
    arr = _numpy_view(x, where)
    if is_immutable(x) or not arr.flags.writeable:
        arr = arr.copy()
    return arr


def _numpy_view(x: Any, where: str, src: Any = None) -> np.ndarray:
    """A NumPy array over the memory of a CPU DLPack array (may be read-only); `src`: what
    `_dlpack_source(x)` gave already (a capsule can be consumed only once)."""
    src = _dlpack_source(x, where) if src is None else src
    dev = _device_type(src)
    if dev not in (KDL_CPU, KDL_CUDA_HOST):
        raise ConfigError(
            f"{where}: the array lives on device {_DEVICE_NAMES.get(dev, dev)}, "
            f"but the host backend needs CPU arrays; use backend='nccl' for GPU "
            f"arrays, or move it to the CPU"
        )
    try:
        return np.from_dlpack(src)
    except (BufferError, TypeError, RuntimeError) as e:
        arr = _bfloat16_view(src)
        if arr is None and is_immutable(x):
            arr = np.asarray(x)
        if arr is None:
            raise ConfigError(f"{where}: cannot view {type(x).__name__} through DLPack ({e})") from e
        return arr


def native_view(x: Any, where: str) -> Any:
    """A native array over `x`'s memory, never a copy: NumPy for CPU memory (read-only when the
    producer says so), CuPy for CUDA memory. For readers that never write it (the grad reducer)."""
    src = _dlpack_source(x, where)
    dev = _device_type(src)
    if dev in (KDL_CPU, KDL_CUDA_HOST):
        return _numpy_view(x, where, src)
    return native_from_dlpack(src, dev)


def _bfloat16_view(src: Any) -> Optional[np.ndarray]:
    """NumPy's DLPack import knows no bfloat16: view the framework array as int16 (torch's
    `tensor.view(torch.int16)`), import that, and reinterpret it with ml_dtypes."""
    framework = sys.modules.get(type(src).__module__.split(".")[0])
    if not hasattr(src, "view"):
        return None
    int16 = getattr(framework, "int16", None)
    if "bfloat16" not in str(getattr(src, "dtype", "")) or int16 is None:
        return None
    return np.from_dlpack(src.view(int16)).view(bfloat16_dtype())


def _to_cupy(x: Any, where: str) -> Any:
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise ConfigError(
            f"{where}: got a NumPy (CPU) array but the nccl backend needs GPU "
            f"arrays; move it to the GPU (cupy.asarray) or use backend='host'"
        )
    src = _dlpack_source(x, where)
    try:
        arr = cupy.from_dlpack(src)
    except (BufferError, TypeError, RuntimeError, ValueError) as e:
        raise ConfigError(
            f"{where}: cannot view {type(x).__name__} on the GPU through DLPack "
            f"({e}); the nccl backend needs GPU arrays"
        ) from e
    return arr.copy() if is_immutable(x) else arr


def from_native(native: Any, like: Any) -> Any:
    """What a collective returns for the caller's `like`: `like` itself when `native` is a view
    of it (written in place), a native array for NumPy/CuPy callers, else a new array of the
    caller's framework (immutable or read-only inputs, which were copied), or what its adapter
    makes of the result (a TensorFlow variable is assigned it)."""
    if native is like:
        return like
    if type(like).__module__.split(".")[0] in frameworks.NATIVE:
        return native  # a read-only NumPy input got a new array
    if not is_immutable(like) and _shares(native, like):
        return like  # a DLPack view of a writable framework array: written in place
    name = frameworks.framework_of(like)
    if name is None:
        return native
    return frameworks.adapter(name).array_from_native(native, like)


def _shares(native: Any, like: Any) -> bool:
    if isinstance(native, np.ndarray):
        return np.may_share_memory(native, _numpy_view(like, ""))
    import cupy

    return cupy.may_share_memory(native, cupy.from_dlpack(_dlpack_source(like, "")))


def native_from_dlpack(x: Any, device_type: int) -> Any:
    """A native array sharing memory with `x` (anything with `__dlpack__`): NumPy for CPU memory,
    CuPy for CUDA memory. NumPy's view is read-only when the producer says so (JAX, MindSpore)."""
    if device_type == KDL_CPU:
        return np.from_dlpack(x)
    if device_type == KDL_CUDA:
        import cupy

        return cupy.from_dlpack(x)
    raise ConfigTypeError(f"arrays on DLPack device type {device_type} are not supported (CPU or CUDA only)")


_DTYPE_ALIASES = {"fp16": "float16", "fp32": "float32", "fp64": "float64", "bf16": "bfloat16"}


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of a framework's dtype object or name: NumPy's own, `tf.float32` (its
    `as_numpy_dtype`), `paddle.float32` / `DataType.FLOAT32` / `torch.bfloat16` / "float32" (by
    name). Raises `ConfigTypeError` for a dtype no NumPy dtype matches."""
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    as_numpy = getattr(dtype, "as_numpy_dtype", None)  # TensorFlow's DType
    if as_numpy is not None:
        try:
            return np.dtype(as_numpy)
        except TypeError:
            pass
    text = dtype if isinstance(dtype, str) else str(getattr(dtype, "name", None) or dtype)
    name = text.strip("<>").split(":")[-1].strip(" '\"").split(".")[-1].lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name == "bfloat16":
        return bfloat16_dtype()
    try:
        return np.dtype(name)
    except TypeError as e:
        raise ConfigTypeError(
            f"dtype {dtype!r} ({type(dtype).__module__}.{type(dtype).__name__}) has no NumPy "
            f"equivalent nccl_ddp can reduce; use a float, int or bool dtype"
        ) from e


def bfloat16_dtype() -> np.dtype:
    """NumPy's bfloat16 (ml_dtypes'), imported only here: only bfloat16 data needs it."""
    try:
        import ml_dtypes
    except ImportError as e:
        raise ConfigError(
            "bfloat16 arrays on the host need the ml_dtypes package (NumPy has no "
            "bfloat16): pip install ml_dtypes"
        ) from e
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: Any) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16, without importing ml_dtypes (no array can be
    bfloat16 unless it is loaded)."""
    return np.dtype(dtype).name == "bfloat16"


class CapsuleHolder:
    """Gives a bare DLPack capsule the `__dlpack__` protocol (for MindSpore's `to_dlpack`)."""

    def __init__(self, capsule: Any, device: Tuple[int, int] = (KDL_CPU, 0)) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, stream: Optional[int] = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device
