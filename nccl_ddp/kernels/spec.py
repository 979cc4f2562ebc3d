"""The bucket kernels' specification: the dtype pairs they take, the checks every call passes, and
the NumPy references that define their results bit for bit (the host backend runs these; the CUDA
kernels of kernels/bucket.cu must equal them). Imported by the dispatcher and the CUDA backend alike.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from nccl_ddp.errors import KernelError
from nccl_ddp.kernels import half

# (tensor dtype, bucket dtype) pairs. pack: tensor -> bucket; unpack: bucket -> tensor.
_SAME = {(t, t) for t in ("float16", "bfloat16", "float32", "float64")}
PACK_PAIRS = frozenset(_SAME | {("float32", "bfloat16"), ("float32", "float16")})
UNPACK_PAIRS = frozenset(_SAME | {("bfloat16", "float32"), ("float16", "float32")})  # (bucket, dst)
SCALE_DTYPES = frozenset(("float16", "bfloat16", "float32", "float64"))


# ---------------------------------------------------------------------------------------------
# validation shared by both paths


def dtype_name(x: Any) -> str:
    """'float32', 'bfloat16', ... for a NumPy or CuPy array."""
    return np.dtype(x.dtype).name


def check_segments(
    op: str, arrays: Sequence[Any], bucket: Any, offsets: Sequence[int], pairs: frozenset, to_bucket: bool
) -> tuple:
    """Validate one pack/unpack call; return (sizes, offsets) as int64 arrays and the
    (tensor dtype, bucket dtype) pair. Raises `KernelError` naming the op and the argument."""
    if len(arrays) != len(offsets):
        raise KernelError(
            f"{op}: {len(arrays)} arrays but {len(offsets)} offsets; pass one bucket offset per array"
        )
    if not bucket.flags.c_contiguous:
        raise KernelError(
            f"{op}: the bucket (shape {bucket.shape}) is not contiguous; allocate "
            "it flat with device.empty(n, dtype)"
        )
    bname = dtype_name(bucket)
    tname = dtype_name(arrays[0]) if len(arrays) else bname
    pair = (tname, bname) if to_bucket else (bname, tname)
    kind = _kind(bucket)
    for i, a in enumerate(arrays):
        if _kind(a) != kind:
            raise KernelError(
                f"{op}: array {i} is a {type(a).__module__}.{type(a).__name__} but "
                f"the bucket is a {kind} array; put both on the same device"
            )
        if dtype_name(a) != tname:
            raise KernelError(
                f"{op}: array {i} is {dtype_name(a)} but array 0 is {tname}; a "
                "bucket holds one dtype group, split the arrays by dtype"
            )
        if not a.flags.c_contiguous:
            raise KernelError(
                f"{op}: array {i} (shape {a.shape}, strides {a.strides}) is not "
                "contiguous; pass a contiguous array (x.copy()) or a view of one"
            )
    if pair not in pairs:
        ok = ", ".join(f"{s}->{d}" for s, d in sorted(pairs))
        raise KernelError(f"{op}: dtype pair {pair[0]}->{pair[1]} is not supported (supported: {ok})")
    sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    try:
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise KernelError(f"{op}: offsets must be integers, got {offsets!r:.80}") from e
    if offs.size and offs.min() < 0:
        i = int(np.argmin(offs))
        raise KernelError(f"{op}: offset {i} is negative ({int(offs[i])})")
    ends = offs + sizes
    if ends.size and ends.max() > bucket.size:
        i = int(np.argmax(ends))
        raise KernelError(
            f"{op}: array {i} ({int(sizes[i])} elements at offset {int(offs[i])}) "
            f"ends past the bucket ({bucket.size} elements); the bucket is too "
            "small for the offsets"
        )
    if to_bucket:
        nz = np.flatnonzero(sizes)
        order = nz[np.argsort(offs[nz], kind="stable")]
        clash = np.flatnonzero(ends[order][:-1] > offs[order][1:])
        if clash.size:
            i, j = int(order[clash[0]]), int(order[clash[0] + 1])
            raise KernelError(
                f"{op}: arrays {i} and {j} overlap in the bucket (offsets "
                f"{int(offs[i])} and {int(offs[j])}); give each its own range"
            )
    if kind != "numpy":
        _check_device_memory(op, arrays, bucket, sizes, offs, to_bucket)
    return sizes, offs, pair


def _check_device_memory(
    op: str, arrays: Sequence[Any], bucket: Any, sizes: np.ndarray, offs: np.ndarray, to_bucket: bool
) -> None:
    """What the GPU kernels cannot take although the references can: a pointer that is not a
    multiple of its element size (a misaligned-address fault kills the CUDA context), unpack
    destinations sharing memory (their updates would race), a pack source overlapping the bucket
    ranges being written (read through the read-only cache while written)."""
    bitem = np.dtype(bucket.dtype).itemsize
    if bucket.data.ptr % bitem:
        raise KernelError(
            f"{op}: the bucket starts at {bucket.data.ptr:#x}, not a multiple of its "
            f"{bitem}-byte element size; allocate it with device.empty(n, dtype)"
        )
    nz = np.flatnonzero(sizes)
    if not nz.size:
        return
    item = np.dtype(arrays[0].dtype).itemsize
    ptrs = np.fromiter((arrays[int(i)].data.ptr for i in nz), dtype=np.int64, count=nz.size)
    odd = np.flatnonzero(ptrs % item)
    if odd.size:
        i = int(nz[odd[0]])
        raise KernelError(
            f"{op}: array {i} starts at {int(ptrs[odd[0]]):#x}, not a multiple of "
            f"its {item}-byte element size (the kernels would fault on a misaligned "
            "address); pass an aligned copy (x.copy())"
        )
    ends = ptrs + sizes[nz] * item
    if not to_bucket:
        order = np.argsort(ptrs, kind="stable")
        clash = np.flatnonzero(ends[order][:-1] > ptrs[order][1:])
        if clash.size:
            i, j = sorted((int(nz[order[clash[0]]]), int(nz[order[clash[0] + 1]])))
            raise KernelError(
                f"{op}: arrays {i} and {j} share memory; unpack destinations must "
                "not overlap (their updates would race and be lost): pass distinct "
                "arrays"
            )
        return
    w_start = bucket.data.ptr + offs[nz] * bitem  # bucket ranges written, disjoint
    order = np.argsort(w_start, kind="stable")
    w_start, w_end = w_start[order], (w_start + sizes[nz] * bitem)[order]
    last = np.searchsorted(w_start, ends, side="left") - 1  # last range starting before the end
    hit = np.flatnonzero((last >= 0) & (w_end[np.maximum(last, 0)] > ptrs))
    if hit.size:
        i = int(nz[hit[0]])
        raise KernelError(
            f"{op}: array {i} overlaps the bucket range being packed (it is read "
            "through the read-only cache while the kernel writes there); pack a "
            "copy of it"
        )


def _kind(x: Any) -> str:
    """'numpy', 'cupy', ...: the array library, i.e. the device an array lives on."""
    return type(x).__module__.partition(".")[0]


def check_flag(op: str, flag: Any, bucket: Any) -> None:
    if flag is None:
        return
    if _kind(flag) != _kind(bucket):
        raise KernelError(
            f"{op}: nonfinite_flag is a {_kind(flag)} array but the bucket is a "
            f"{_kind(bucket)} array; allocate the flag on the bucket's device"
        )
    if dtype_name(flag) != "int32" or flag.size < 1:
        raise KernelError(
            f"{op}: nonfinite_flag must be an int32 array of at least one "
            f"element, got {dtype_name(flag)} of size {flag.size}"
        )


def check_flat(op: str, buf: Any, dtypes: Optional[frozenset]) -> None:
    if not buf.flags.c_contiguous:
        raise KernelError(f"{op}: the buffer (shape {buf.shape}) is not contiguous")
    if dtypes is not None and dtype_name(buf) not in dtypes:
        raise KernelError(
            f"{op}: dtype {dtype_name(buf)} is not supported (supported: {', '.join(sorted(dtypes))})"
        )


# ---------------------------------------------------------------------------------------------
# NumPy references: the specification of every kernel


def acc_dtype(pair: tuple) -> type:
    """The arithmetic type of a dtype pair: float64 for float64 data, else float32."""
    return np.float64 if "float64" in pair else np.float32


def pack_ref(
    srcs: Sequence[np.ndarray],
    dst: np.ndarray,
    offsets: Sequence[int],
    *,
    scale: float = 1.0,
    nonfinite_flag: Optional[np.ndarray] = None,
) -> None:
    """Reference of `pack` (NumPy arrays). A narrowing pack (float32 into a bfloat16/float16
    bucket) rounds to the bucket dtype first and scales that: torch's compress hooks' order."""
    sizes, offs, pair = check_segments("pack", srcs, dst, offsets, PACK_PAIRS, to_bucket=True)
    check_flag("pack", nonfinite_flag, dst)
    acc = acc_dtype(pair)
    s = acc(scale)
    flat = dst.reshape(-1)
    bad = False
    with np.errstate(over="ignore", invalid="ignore"):
        for x, o, n in zip(srcs, offs, sizes):
            if n == 0:
                continue
            x = x.reshape(-1)
            y = flat[o : o + n]
            if x.dtype == dst.dtype == acc:  # float32/float64: the same rounding, no temporaries
                _scaled_into(y, x, s)
            elif x.dtype == np.float32 and dst.dtype == np.float16:  # these bits, faster
                half.pack_scaled(y, x, s)
            else:
                if dst.dtype.itemsize < x.dtype.itemsize:
                    x = x.astype(dst.dtype)
                y[...] = (x.astype(acc) * s).astype(dst.dtype)
            if nonfinite_flag is not None and not bad:
                bad = not _all_finite(y, acc)
    if bad and nonfinite_flag is not None:
        nonfinite_flag.reshape(-1)[0] = 1


def unpack_ref(
    dsts: Sequence[np.ndarray],
    src: np.ndarray,
    offsets: Sequence[int],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    nonfinite_flag: Optional[np.ndarray] = None,
) -> None:
    """Reference of `unpack` (NumPy arrays). `nonfinite_flag`: set to 1 if a value written is
    NaN/Inf (what a reduction handed back, seen where it is written anyway)."""
    sizes, offs, pair = check_segments("unpack", dsts, src, offsets, UNPACK_PAIRS, to_bucket=False)
    check_flag("unpack", nonfinite_flag, src)
    acc = acc_dtype(pair)
    s = acc(scale)
    flat = src.reshape(-1)
    bad = False
    with np.errstate(over="ignore", invalid="ignore"):
        for d, o, n in zip(dsts, offs, sizes):
            if n == 0:
                continue
            seg, out = flat[o : o + n], d.reshape(-1)
            if seg.dtype == out.dtype == acc:  # float32/float64: the same rounding, fewer passes
                if not accumulate:
                    _scaled_into(out, seg, s)
                elif s == 1:
                    np.add(out, seg, out=out)
                else:
                    np.add(out, seg * s, out=out)
            elif seg.dtype == np.float16 and out.dtype == acc and not accumulate:
                half.unpack_scaled(out, seg, s)
            else:
                v = seg.astype(acc) * s
                if accumulate:
                    v = out.astype(acc) + v
                out[...] = v.astype(d.dtype)
            if nonfinite_flag is not None and not bad:
                bad = not _all_finite(out, acc)
    if bad and nonfinite_flag is not None:
        nonfinite_flag.reshape(-1)[0] = 1


def flag_nonfinite_ref(
    views: Sequence[np.ndarray], bucket: np.ndarray, offsets: Sequence[int], flag: np.ndarray
) -> None:
    """Reference of `flag_nonfinite`: flag[0] = 1 if a view holds a NaN/Inf (never cleared).
    `views` are `bucket`'s own elements at `offsets` (padding between them is not looked at)."""
    check_segments("flag_nonfinite", views, bucket, offsets, UNPACK_PAIRS, to_bucket=False)
    check_flag("flag_nonfinite", flag, bucket)
    acc = acc_dtype((dtype_name(bucket),))
    if not all(bool(np.isfinite(v.astype(acc)).all()) for v in views):
        flag.reshape(-1)[0] = 1


def scale_ref(buf: np.ndarray, factor: float) -> None:
    """Reference of `scale_` (NumPy array)."""
    check_flat("scale_", buf, SCALE_DTYPES)
    acc = acc_dtype((dtype_name(buf),))
    f = acc(factor)
    with np.errstate(over="ignore", invalid="ignore"):
        if buf.dtype == acc:  # float32/float64: one multiply in place, the same rounding
            np.multiply(buf, f, out=buf)
            return
        flat = buf.reshape(-1)  # float16/bfloat16: float32 products rounded once, block by block
        for lo in range(0, flat.size, _BLOCK):
            part = flat[lo : lo + _BLOCK]
            wide: np.ndarray = part.astype(acc)
            wide *= f
            np.copyto(part, wide, casting="unsafe")


_BLOCK = 1 << 16  # elements per widened block of a half-precision scale (256 KiB of float32)


def _scaled_into(out: np.ndarray, x: np.ndarray, s: Any) -> None:
    """out = x * s in x's own dtype (a copy when s is 1)."""
    if s == 1:
        np.copyto(out, x)
    else:
        np.multiply(x, s, out=out)


def _all_finite(a: np.ndarray, acc: type) -> bool:
    """No NaN/Inf in `a` (half dtypes looked at widened to `acc`)."""
    return bool(np.isfinite(a if a.dtype == acc else a.astype(acc)).all())


def zero_ref(buf: np.ndarray) -> None:
    """Reference of `zero_` (NumPy array)."""
    check_flat("zero_", buf, None)
    buf[...] = 0
