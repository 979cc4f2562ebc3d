"""Seeded random kernel cases shared by the CPU execution tests and the GPU check
(scripts/gpu_kernel_cases.py), so a case that fails on the GPU replays on the CPU by its seed; and
the raw-byte comparison both use.

Comparison policy (`compare_bytes`): every element's bytes must equal the reference's, so -0.0
against +0.0 is a mismatch. Where the reference is a NaN the result must be a NaN whose payload is
the reference's or the dtype's canonical NaN (all exponent and mantissa bits set but the sign: what
NVIDIA GPUs' float arithmetic and conversions produce); any other payload, or a NaN where the
reference has a number, is a mismatch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from nccl_ddp import kernels as K
from nccl_ddp.kernels import cuda as ck
from nccl_ddp.kernels.optim_spec import GRAD_DTYPES, PARAM_DTYPES
from nccl_ddp.kernels.spec import PACK_PAIRS, SCALE_DTYPES, UNPACK_PAIRS

OPTIM_OPS = ("sgd", "adamw")  # kernels/optim.cu; the other ops are bucket.cu's


def _bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


DT = {
    "float16": np.dtype(np.float16),
    "bfloat16": _bf16(),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
CANONICAL_NAN = {2: 0x7FFF, 4: 0x7FFF_FFFF, 8: 0x7FFF_FFFF_FFFF_FFFF}
SCALES = [1.0, 0.5, 1 / 3, 0.125, 3.0, 1e-3, 2.0**-20]


def values(rng, n, dtype, special=True, nonfinite=False):
    """Random values of `dtype` over its whole range: normals of every exponent, subnormals, -0.0,
    +-0.0, near-overflow values; inf/NaN when `nonfinite`."""
    dt = DT[dtype]
    if dtype == "float64":
        x = rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)
    else:
        x = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, n).astype(
            np.float32
        )
    x = x.astype(dt)
    if special and n:
        k = max(1, n // 8)
        idx = rng.integers(0, n, (6, k))
        tiny = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149, "float64": 2.0**-1074}[
            dtype
        ]
        x[idx[0]] = (rng.integers(1, 1000, k) * tiny * rng.choice([-1, 1], k)).astype(dt)
        x[idx[1]] = dt.type(-0.0)
        x[idx[2]] = dt.type(0.0)
        big = {"float16": 60000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1e300}[dtype]
        x[idx[3]] = (big * rng.uniform(0.5, 1, k)).astype(dt)
        x[idx[4]] = (1e-38 * rng.uniform(0.01, 2, k)).astype(dt) if dtype != "float16" else x[idx[4]]
        if nonfinite:
            x[idx[5][: max(1, k // 4)]] = rng.choice([np.inf, -np.inf, np.nan], max(1, k // 4))
    return x


def sizes(rng, count):
    """Tensor sizes: small ones (0..23) for many tensors, else up to 3000 with some of 1..16."""
    if count > 100:
        s = rng.integers(0, 24, count)
    else:
        s = rng.integers(0, 3000, count)
        s[rng.integers(0, count, max(1, count // 4))] = rng.integers(1, 17, max(1, count // 4))
    return s


def compare_bytes(got, want) -> dict:
    """Raw-byte comparison under the module's policy: {"mismatches", "canonical_nans", "first"}."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.dtype != want.dtype or got.shape != want.shape:
        return {
            "mismatches": max(got.size, want.size),
            "canonical_nans": 0,
            "first": f"dtype/shape {got.dtype}{got.shape} vs {want.dtype}{want.shape}",
        }
    u = UINT[got.dtype.itemsize]
    gb, wb = got.view(u), want.view(u)
    sign = u(1) << u(8 * got.dtype.itemsize - 1)
    want_nan = np.isnan(want.astype(np.float64))
    canon = want_nan & ((gb & ~sign) == u(CANONICAL_NAN[got.dtype.itemsize])) & (gb != wb)
    bad = np.flatnonzero((gb != wb) & ~canon)
    first = ""
    if bad.size:
        i = bad[:4]
        first = f"at {i.tolist()}: got {[hex(int(x)) for x in gb[i]]} want {[hex(int(x)) for x in wb[i]]}"
    return {"mismatches": int(bad.size), "canonical_nans": int(canon.sum()), "first": first}


def source_of(case: tuple) -> str:
    return "optim.cu" if case[1] in OPTIM_OPS else "bucket.cu"


def plan() -> list:
    """(name, op, pair, variant, count) covering every instantiation of the module: bucket.cu's
    pack and unpack variants with a by-value table (5 tensors) and a device table (40), each
    scale; optim.cu's sgd/adamw for every (grad, param) dtype pair."""
    cases = []
    for op, pairs in (("pack", PACK_PAIRS), ("unpack", UNPACK_PAIRS)):
        for pair in sorted(pairs):
            for variant in (False, True):
                for count in (5, 40):
                    name = ck.kernel_name(op, pair, variant, count <= ck.SMALL_MAX)
                    cases.append((name, op, pair, variant, count))
    for t in sorted(SCALE_DTYPES):
        cases.append((ck.kernel_name("scale", (t, t), False, False), "scale", (t, t), False, 0))
    for op in OPTIM_OPS:
        for g in sorted(GRAD_DTYPES):
            for p in sorted(PARAM_DTYPES):
                cases.append((ck.optim_kernel_name(op, g, p), op, (g, p), False, 0))
    return cases


def _optim_case(put, get, rng, op: str, pair: tuple, add: Callable[[dict], None]) -> None:
    """One sgd/adamw step on a vector-path shard and a misaligned odd one, against the NumPy
    step (the same call on host arrays); every array it writes compared."""
    gt, pt = pair
    for n, mis in ((3001, 0), (37, 1)):
        if op == "sgd":
            kw = dict(
                lr=float(rng.choice([0.1, 1e-3])),
                momentum=0.9,
                dampening=0.0,
                weight_decay=float(rng.choice([0.0, 1e-2])),
                nesterov=bool(rng.integers(2)),
                fresh_buffer=False,
                grad_scale=float(rng.choice(SCALES)),
            )
            names = ["buf"]
        else:
            kw = dict(
                step=int(rng.choice([1, 7, 1000])),
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=float(rng.choice([1e-8, 1e-40])),
                weight_decay=0.1,
                amsgrad=bool(rng.integers(2)),
                grad_scale=float(rng.choice(SCALES)),
            )
            names = ["exp_avg", "exp_avg_sq"] + (["vmax"] if kw["amsgrad"] else [])
        host = {"master": values(rng, n, "float32"), "grad": values(rng, n, gt, nonfinite=True)}
        for name in names:
            x = values(rng, n, "float32")
            x[~np.isfinite(x.astype(np.float64))] = 1.0
            host[name] = x if name == "exp_avg" else np.abs(x)
        host["out"] = np.full(n, np.nan, DT[pt])
        dev = {k: put(h, mis * h.dtype.itemsize) for k, h in host.items()}
        for a in (dev, host):  # the device step, then the reference on the host arrays
            if op == "sgd":
                K.sgd_step(a["master"], a["grad"], a["buf"], a["out"], **kw)
            else:
                K.adamw_step(
                    a["master"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a.get("vmax"), a["out"], **kw
                )
        for k in ["master", "out"] + names:
            add(compare_bytes(get(dev[k]), host[k]))


def seed_of(name: str, seed: int) -> list:
    """The generator seed of one case: the run's seed and the instantiation's name."""
    return [seed, *name.encode()]


def run_case(
    put: Callable[[np.ndarray, int], Any], get: Callable[[Any], np.ndarray], case: tuple, seed: int
) -> dict:
    """Run one case through nccl_ddp.kernels on arrays made by `put(host, misalign_bytes)` and
    read back by `get`; compare with the NumPy references. Returns compare_bytes' dict plus the
    flag check and the case's description."""
    name, op, pair, variant, count = case
    rng = np.random.default_rng(seed_of(name, seed))
    scale = float(rng.choice(SCALES))
    res = {
        "name": name,
        "seed": seed,
        "count": count,
        "scale": scale,
        "mismatches": 0,
        "canonical_nans": 0,
        "first": "",
    }

    def add(r):
        res["mismatches"] += r["mismatches"]
        res["canonical_nans"] += r["canonical_nans"]
        res["first"] = res["first"] or r["first"]

    if op in OPTIM_OPS:
        _optim_case(put, get, rng, op, pair, add)
        return res
    if op == "scale":
        t = pair[0]
        for n, mis in ((1, 0), (13, 1), (40_001, 0), (5003, 3)):
            x = values(rng, n, t, nonfinite=True)
            d = put(x, DT[t].itemsize * mis)
            K.scale_(d, scale)
            want = x.copy()
            K.scale_ref(want, scale)
            add(compare_bytes(get(d), want))
        return res
    s = sizes(rng, count)
    offs = (np.cumsum(s + rng.integers(0, 3, count)) - s).tolist()
    total = int(offs[-1] + s[-1] + 5)
    if op == "pack":
        src_t, bkt_t = pair
        hosts = [values(rng, int(n), src_t, nonfinite=variant and i % 5 == 1) for i, n in enumerate(s)]
        devs = [put(h, DT[src_t].itemsize * (i % 3)) for i, h in enumerate(hosts)]
        fill = np.full(total, np.nan, DT[bkt_t])
        bucket, want = put(fill, 0), fill.copy()
        f_dev = put(np.zeros(1, np.int32), 0) if variant else None
        f_ref = np.zeros(1, np.int32) if variant else None
        K.pack(devs, bucket, offs, scale=scale, nonfinite_flag=f_dev)
        K.pack_ref(hosts, want, offs, scale=scale, nonfinite_flag=f_ref)
        add(compare_bytes(get(bucket), want))
        if variant and int(get(f_dev)[0]) != int(f_ref[0]):
            res["mismatches"] += 1
            res["first"] = res["first"] or f"non-finite flag {int(get(f_dev)[0])} != {f_ref[0]}"
        return res
    bkt_t, dst_t = pair
    bucket_h = values(rng, total, bkt_t, nonfinite=True)
    inits = [values(rng, int(n), dst_t) for n in s]
    outs = [put(h, DT[dst_t].itemsize * (i % 3)) for i, h in enumerate(inits)]
    want = [h.copy() for h in inits]
    K.unpack(outs, put(bucket_h, 0), offs, scale=scale, accumulate=variant)
    K.unpack_ref(want, bucket_h, offs, scale=scale, accumulate=variant)
    for o, w in zip(outs, want):
        add(compare_bytes(get(o), w))
    return res
