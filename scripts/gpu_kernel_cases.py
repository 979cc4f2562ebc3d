#!/usr/bin/env python3
"""Every kernel instantiation on the GPU against the NumPy references, as raw bytes.

    python scripts/gpu_kernel_cases.py [--seed N] [--json out.json] [--once] [--only NAME]

Cases come from tests/support/kernel_cases.py, the generator of the CPU execution tests: the seed of a
case is (--seed, instantiation name), so a failure printed here replays on the CPU with
`NCCL_DDP_CASE='NAME' NCCL_DDP_CASE_SEED=N pytest tests/scripts/test_gpu_check.py -k replay`. Comparison
policy: tests/support/kernel_cases.py's docstring (-0.0 != +0.0; a NaN must keep the reference's payload
or be the canonical NaN). Inputs cover subnormals, -0.0, near-overflow values and inf/NaN.

--once launches each instantiation once on a small case (the compute-sanitizer driver). Every
kernels/*.cu is listed: a source without a case generator here is reported as not covered.
Exit status: 0 all cases equal, 1 a mismatch or an error, 2 no GPU/CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import numpy as np  # noqa: E402


def generators() -> dict:
    """kernels/*.cu file name -> (its cases, run_case) for the sources this script covers."""
    import kernel_cases as kc

    out: dict = {}
    for case in kc.plan():
        out.setdefault(kc.source_of(case), []).append(case)
    return {src: (lambda cases=cases: cases, kc.run_case) for src, cases in out.items()}


def sources() -> list:
    from nccl_ddp.kernels.cuda import kernel_source_dir

    return sorted(p.name for p in kernel_source_dir().glob("*.cu"))


def device_io(cp: Any) -> tuple:
    """put(host, misalign_bytes) -> device array (misaligned inside a byte buffer); get(array)."""

    def put(host: np.ndarray, misalign: int) -> Any:
        raw = cp.empty(host.nbytes + misalign, dtype=cp.uint8)
        view = raw[misalign : misalign + host.nbytes]
        view.set(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        return view.view(host.dtype)

    def get(arr: Any) -> np.ndarray:
        u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize]
        return arr.view(u).get().view(arr.dtype)

    return put, get


def run(cp: Any, seed: int, once: bool, only: Optional[str] = None) -> dict:
    """Run the cases; the result as the JSON written by --json."""
    put, get = device_io(cp)
    gens = generators()
    out: dict = {
        "seed": seed,
        "once": once,
        "cases": [],
        "errors": [],
        "uncovered": [s for s in sources() if s not in gens],
    }
    t0 = time.monotonic()
    for src, (plan, run_case) in sorted(gens.items()):
        cases = [c for c in plan() if only is None or c[0] == only]
        if once:  # one case per instantiation
            seen: set = set()
            cases = [c for c in cases if not (c[0] in seen or seen.add(c[0]))]
        for case in cases:
            try:
                res = run_case(put, get, case, seed)
            except Exception as e:  # one broken case must not hide the others
                out["errors"].append(
                    {
                        "name": case[0],
                        "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc(limit=3),
                    }
                )
                continue
            res["source"] = src
            out["cases"].append(res)
    cp.cuda.Device().synchronize()
    names = {c["name"] for c in out["cases"]}
    out["instantiations"] = len(names)
    out["failed"] = sorted(
        {c["name"] for c in out["cases"] if c["mismatches"]} | {e["name"] for e in out["errors"]}
    )
    out["canonical_nans"] = sum(c["canonical_nans"] for c in out["cases"])
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seed",
        type=int,
        default=int(time.strftime("%Y%m%d")),
        help="run seed (default: today's date, printed for replay)",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--once", action="store_true", help="each instantiation once on a small case (sanitizer driver)"
    )
    ap.add_argument("--only", help="run only this instantiation name")
    args = ap.parse_args(argv)
    try:
        import cupy as cp

        if not cp.cuda.is_available() or cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
    except Exception as e:
        print(f"gpu_kernel_cases: no GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    res = run(cp, args.seed, args.once, args.only)
    for c in res["cases"]:
        if c["mismatches"]:
            print(
                f"MISMATCH {c['name']} seed={c['seed']} count={c['count']} "
                f"scale={c['scale']:g}: {c['mismatches']} elements, {c['first']}"
            )
    for e in res["errors"]:
        print(f"ERROR {e['name']}: {e['error']}\n{e['trace']}")
    for s in res["uncovered"]:
        print(f"NOT COVERED kernels/{s}: no case generator in scripts/gpu_kernel_cases.py")
    print(
        f"kernel cases: {len(res['cases'])} cases, {res['instantiations']} instantiations, "
        f"{len(res['failed'])} failed, {res['canonical_nans']} canonical NaNs, seed "
        f"{args.seed}, {res['seconds']} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if res["failed"]:
        print(
            "replay on the CPU: NCCL_DDP_CASE='<name>' NCCL_DDP_CASE_SEED="
            f"{args.seed} pytest tests/scripts/test_gpu_check.py -k replay"
        )
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
