#!/usr/bin/env bash
# One short run on one GPU that proves the GPU path (docs/gpu-results.md says what it proves):
#   env        compile and launch one tiny RawKernel; versions, GPU, kernel cache
#   kernels    every kernel instantiation on seeded random cases (the CPU tests' generator),
#              bit for bit as raw bytes, subnormals included (scripts/gpu_kernel_cases.py)
#   san_*      compute-sanitizer memcheck, racecheck, synccheck over a driver launching every
#              instantiation once ("sanitizer unavailable: <message>" when refused)
#   oracle     torch DDP (nccl) vs ours (nccl backend) at world 1: BatchNorm CNN, bf16 autocast,
#              a frozen layer, 20 steps, parameters+buffers bit for bit; DDP overhead vs no DDP
#   trace      torch.profiler CUPTI trace of DDP steps with several buckets (trace.json)
#   overlap    scripts/overlap_report.py on it: per stream, hidden share of comm, pack/unpack
#   bench      pack/unpack GB/s vs a D2D copy: 1, 25, 100 MiB x 10, 100, 1000 tensors
#   pytest     the suite's gpu-marked tests (fully_shard on one GPU among them)
# Each step runs under `timeout` and its failure is reported without stopping the others; the
# worst case, graces included, stays under GPU_CHECK_BUDGET (400 s) or the run does not start.
#
# Usage: bash scripts/gpu_check.sh [--help | --budget]
#   --help     print this and exit
#   --budget   print each step's limit + kill grace and the worst-case total, and exit
# Results under $OUT if set, else out/gpu_check/ (flat, at most 8 files): summary.txt (the table,
# also printed last), results.json (every figure), log.txt (every step's output), bench.csv,
# oracle.csv, trace.json, overlap.json, pytest.txt.
# Limits (seconds): GPU_CHECK_<STEP>_TIMEOUT for ENV KERNELS SANITIZER (per tool) ORACLE TRACE
# OVERLAP BENCH PYTEST SUMMARY; GPU_CHECK_GRACE (kill grace per step); GPU_CHECK_BUDGET.
# Exit status: 0 all steps passed (a sanitizer the runtime refuses counts as passed), 1 a step
# failed or timed out, 2 no GPU or over budget,
# 64 bad usage. Runs from the working tree (PYTHONPATH=., nothing installed).
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1

usage() { sed -n '2,/^# 64 bad usage/p' "$0" | sed 's/^# \{0,1\}//'; }

MODE=run
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --budget) MODE=budget ;;
    "") ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 64 ;;
esac

GRACE=${GPU_CHECK_GRACE:-3}
BUDGET=${GPU_CHECK_BUDGET:-400}
declare -A LIMIT=(
    [env]=${GPU_CHECK_ENV_TIMEOUT:-25}
    [kernels]=${GPU_CHECK_KERNELS_TIMEOUT:-50}
    [san_memcheck]=${GPU_CHECK_SANITIZER_TIMEOUT:-25}
    [san_racecheck]=${GPU_CHECK_SANITIZER_TIMEOUT:-25}
    [san_synccheck]=${GPU_CHECK_SANITIZER_TIMEOUT:-25}
    [oracle]=${GPU_CHECK_ORACLE_TIMEOUT:-55}
    [trace]=${GPU_CHECK_TRACE_TIMEOUT:-35}
    [overlap]=${GPU_CHECK_OVERLAP_TIMEOUT:-10}
    [bench]=${GPU_CHECK_BENCH_TIMEOUT:-40}
    [pytest]=${GPU_CHECK_PYTEST_TIMEOUT:-55}
    [summary]=${GPU_CHECK_SUMMARY_TIMEOUT:-10}
)
ORDER=(env kernels san_memcheck san_racecheck san_synccheck oracle trace overlap bench pytest
       summary)
TOTAL=0
for s in "${ORDER[@]}"; do TOTAL=$((TOTAL + ${LIMIT[$s]} + GRACE)); done
if [ "$MODE" = budget ]; then
    for s in "${ORDER[@]}"; do printf '%-14s %4d s + %d s grace\n' "$s" "${LIMIT[$s]}" "$GRACE"; done
    printf 'worst case     %4d s (budget %d s)\n' "$TOTAL" "$BUDGET"
    [ "$TOTAL" -lt "$BUDGET" ] && exit 0 || exit 2
fi
if [ "$TOTAL" -ge "$BUDGET" ]; then
    echo "gpu_check.sh: the step limits add up to ${TOTAL}s worst case (graces included), over" \
         "the ${BUDGET}s budget; lower a GPU_CHECK_*_TIMEOUT (--budget lists them)" >&2
    exit 2
fi

PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_DDP_NO_PROGRESS=1 PYTHONDONTWRITEBYTECODE=1
RES=${OUT:-out/gpu_check}
mkdir -p "$RES"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG="$RES/log.txt"
: > "$LOG"
: > "$WORK/steps"

# step NAME CMD...: CMD under timeout (LIMIT[NAME] + GRACE at worst), its output to the console,
# log.txt and $WORK/NAME.out; "NAME rc seconds" recorded for the summary. Never fails the script.
step() {
    local name=$1 limit=${LIMIT[$1]}
    shift
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after="$GRACE" "$limit" "$@" > "$WORK/$name.out" 2>&1
    local rc=$?
    tee -a "$LOG" < "$WORK/$name.out" | tail -n 40
    echo "$name $rc $((SECONDS - t0))" >> "$WORK/steps"
    echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
    return 0
}

skip() {
    echo "$1 skipped 0" >> "$WORK/steps"
    echo "=== $1: skipped ($2)" | tee -a "$LOG"
}

# -- environment ------------------------------------------------------------------------------
step env "$PY" - <<'EOF'
import os
import platform
print(f"python={platform.python_version()}")
try:
    import cupy as cp
    print(f"cupy={cp.__version__}")
    n = cp.cuda.runtime.getDeviceCount() if cp.cuda.is_available() else 0
    print(f"gpus={n}")
    if n:
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        print(f"gpu={name.decode() if isinstance(name, bytes) else name}")
        print(f"memory_gib={props['totalGlobalMem'] / 2**30:.0f}")
        print(f"sm={props['major']}{props['minor']}")
        print(f"sms={props['multiProcessorCount']}")
        print(f"driver={cp.cuda.runtime.driverGetVersion()}")
        print(f"runtime={cp.cuda.runtime.runtimeGetVersion()}")
        cache = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
        try:
            os.makedirs(cache, exist_ok=True)
            writable = os.access(cache, os.W_OK)
        except OSError:
            writable = False
        print(f"kernel_cache={cache}{'' if writable else ' (NOT WRITABLE: set CUPY_CACHE_DIR)'}")
        try:   # one tiny kernel through NVRTC, the driver and a launch
            k = cp.RawKernel(r'''extern "C" __global__ void probe(float* x) {
                x[threadIdx.x] = 2.0f * threadIdx.x; }''', "probe")
            x = cp.zeros(32, dtype=cp.float32)
            k((1,), (32,), (x,))
            got = cp.asnumpy(x)
            print("probe=ok" if float(got[3]) == 6.0 else f"probe=WRONG RESULT {got[:4]}")
        except Exception as e:
            msg = " ".join(str(e).split())[:300]
            print(f"probe=FAILED {type(e).__name__}: {msg}")
    try:
        from cupy.cuda import nccl
        print(f"nccl={nccl.get_version() if nccl.available else 'unavailable'}")
    except Exception as e:
        print(f"nccl=unavailable ({type(e).__name__})")
except Exception as e:
    print("gpus=0")
    print(f"cupy=unusable ({type(e).__name__}: {str(e)[:100]})")
for mod in ("torch", "numpy"):
    try:
        m = __import__(mod)
        print(f"{mod}={m.__version__}")
    except Exception:
        print(f"{mod}=missing")
EOF
cp "$WORK/env.out" "$WORK/env"
GPUS=$(sed -n 's/^gpus=//p' "$WORK/env" | head -n1)
GPUS=${GPUS:-0}
if [ "$GPUS" = "0" ]; then
    echo "NO GPU: CuPy sees no CUDA device; the GPU steps are skipped." | tee -a "$LOG"
fi

# -- GPU steps --------------------------------------------------------------------------------
RUN=("$PY" -m nccl_ddp.launch --nproc-per-node 1)
if [ "$GPUS" = "0" ]; then
    for s in kernels san_memcheck san_racecheck san_synccheck oracle trace overlap bench; do
        skip "$s" "no GPU"
    done
else
    step kernels "$PY" scripts/gpu_kernel_cases.py --json "$WORK/kernels.json"
    SAN=$(command -v compute-sanitizer || true)
    NVCC=$(command -v nvcc || true)
    for d in ${NVCC:+"$(dirname "$NVCC")"} /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
        [ -z "$SAN" ] && [ -x "$d/compute-sanitizer" ] && SAN="$d/compute-sanitizer"
    done
    if [ -z "$SAN" ]; then
        echo "compute-sanitizer not found on PATH, beside nvcc or in /usr/local/cuda" \
            > "$WORK/sanitizer_missing"
        for t in memcheck racecheck synccheck; do skip "san_$t" "no compute-sanitizer"; done
    else
        for t in memcheck racecheck synccheck; do
            step "san_$t" "$SAN" --tool "$t" --error-exitcode 86 --print-limit 20 \
                "$PY" scripts/gpu_kernel_cases.py --once
        done
    fi
    step oracle "${RUN[@]}" scripts/gpu_torch_oracle.py --json "$WORK/oracle.json" \
        --csv "$RES/oracle.csv"
    step trace "${RUN[@]}" scripts/gpu_trace.py --out "$RES/trace.json"
    if [ -f "$RES/trace.json" ]; then
        step overlap "$PY" scripts/overlap_report.py "$RES/trace.json" --json "$RES/overlap.json"
    else
        skip overlap "no trace.json"
    fi
    step bench "$PY" scripts/bench_kernels.py --sizes 1,25,100 --counts 10,100,1000 \
        --pairs f32,f32-bf16 --ops pack,unpack --reps 10 --csv "$RES/bench.csv" --png ""
fi

# -- the suite's gpu tests (they skip themselves without a GPU) -------------------------------
FIRST=()
if [ -f scripts/pytest_gpu_first.py ]; then
    FIRST=(-p pytest_gpu_first)
    export PYTHONPATH="scripts:$PYTHONPATH"
fi
step pytest "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider ${FIRST[@]+"${FIRST[@]}"} \
    -o timeout=40 tests
cp "$WORK/pytest.out" "$RES/pytest.txt"

# -- summary (printed last) -------------------------------------------------------------------
timeout --kill-after="$GRACE" "${LIMIT[summary]}" "$PY" scripts/gpu_check_summary.py "$WORK" "$RES"
VERDICT=$?   # 0 all ok (a sanitizer the runtime refused counts as ok), 1 a step failed

if [ "$GPUS" = "0" ]; then
    exit 2
fi
if [ "$VERDICT" -gt 1 ]; then   # no summary: judge by the exit codes alone
    echo "gpu_check.sh: the summary failed (exit $VERDICT); see $LOG"
    awk '$2 != "0" && $2 != "skipped" {bad = 1} END {exit !bad}' "$WORK/steps" && exit 1
    exit 0
fi
exit "$VERDICT"
