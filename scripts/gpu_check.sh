#!/usr/bin/env bash
# One-command GPU check for one GPU (under 7 minutes whatever happens): an environment probe that
# compiles and runs one tiny RawKernel (missing CUDA headers, an unwritable kernel cache or a
# broken driver are named in the summary instead of failing every test), the GPU tests of the
# whole suite (`pytest -m gpu`, 180 s; the kernels bit for bit, torch on CUDA streams and bfloat16
# first: scripts/pytest_gpu_first.py), the kernel benchmark and a chunk-size sweep, then the NCCL
# all-reduce benchmark with one rank and the DDP benchmark. Each step is bounded by `timeout`.
# Runs from the working tree (PYTHONPATH=., nothing installed); needs one CUDA GPU, CuPy, NCCL.
#
#   bash scripts/gpu_check.sh            # results under $OUT if set, else out/gpu_check/
#
# Files (flat, at most 8): log.txt (every step's output), pytest.txt, kernels.csv, chunks.csv,
# allreduce.csv, ddp.csv, kernels.png, summary.txt. The summary table is printed LAST.
# Exit status: 0 all steps passed, 1 a step failed or timed out, 2 no GPU (benchmarks skipped).
# Timeouts (seconds) can be changed with GPU_CHECK_{PROBE,PYTEST,KERNELS,CHUNKS,ALLREDUCE,DDP}_TIMEOUT
# (defaults 45+180+65+30+35+35 = 390 s).
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
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

# step NAME TIMEOUT CMD...: run CMD bounded, its output to the console, log.txt and
# $WORK/NAME.out; record "NAME rc seconds" for the summary.
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.out" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "$name $rc $((SECONDS - t0))" >> "$WORK/steps"
    echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
    return 0
}

skip() {
    echo "$1 skipped 0" >> "$WORK/steps"
    echo "=== $1: skipped ($2)" | tee -a "$LOG"
}

# -- environment ------------------------------------------------------------------------------
timeout --kill-after=5 "${GPU_CHECK_PROBE_TIMEOUT:-45}" "$PY" - > "$WORK/env" 2>&1 <<'EOF'
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
    print(f"gpus=0")
    print(f"cupy=unusable ({type(e).__name__}: {str(e)[:100]})")
for mod in ("torch", "jax", "numpy"):
    try:
        m = __import__(mod)
        print(f"{mod}={m.__version__}")
    except Exception as e:
        print(f"{mod}=missing")
EOF
tee -a "$LOG" < "$WORK/env"
GPUS=$(sed -n 's/^gpus=//p' "$WORK/env" | head -n1)
GPUS=${GPUS:-0}
if [ "$GPUS" = "0" ]; then
    echo "NO GPU: CuPy sees no CUDA device; the gpu tests will be skipped and the benchmarks" \
         "are not run." | tee -a "$LOG"
fi

# -- tests ------------------------------------------------------------------------------------
# -v names each test as it starts (a step killed by its timeout still shows which test hung);
# a per-test limit well under the step's (pytest-timeout dumps the stacks of a hung test and the
# run goes on; -o, not --timeout, so a missing plugin is a warning, not a usage error).
FIRST=()
if [ -f scripts/pytest_gpu_first.py ]; then
    FIRST=(-p pytest_gpu_first)
    export PYTHONPATH="scripts:$PYTHONPATH"
fi
step pytest "${GPU_CHECK_PYTEST_TIMEOUT:-180}" \
    "$PY" -m pytest -m gpu -v -p no:cacheprovider ${FIRST[@]+"${FIRST[@]}"} -o timeout=75 --durations=12 tests
cp "$WORK/pytest.out" "$RES/pytest.txt"

# -- benchmarks -------------------------------------------------------------------------------
if [ "$GPUS" = "0" ]; then
    for s in kernels chunks allreduce ddp; do skip "$s" "no GPU"; done
else
    step kernels "${GPU_CHECK_KERNELS_TIMEOUT:-65}" \
        "$PY" scripts/bench_kernels.py --sizes 1,25,100 --counts 1,100,10000 --reps 20 \
        --csv "$RES/kernels.csv" --png "$RES/kernels.png"
    step chunks "${GPU_CHECK_CHUNKS_TIMEOUT:-30}" \
        "$PY" scripts/bench_kernels.py --sizes 25 --counts 1,100 --pairs f32 \
        --chunk-bytes 0,2048,4096,8192,16384,32768 --reps 20 --csv "$RES/chunks.csv" --png ""
    if [ -f scripts/bench_allreduce.py ]; then
        step allreduce "${GPU_CHECK_ALLREDUCE_TIMEOUT:-35}" \
            "$PY" scripts/bench_allreduce.py --backend nccl --nranks 1 --no-gloo --max 256M \
            --iters 10 --timeout 35 --png "" --csv "$WORK/allreduce.csv"
        [ -f "$WORK/allreduce.csv" ] && cp "$WORK/allreduce.csv" "$RES/allreduce.csv"
    else
        skip allreduce "scripts/bench_allreduce.py not found"
    fi
    if [ -f scripts/bench_ddp.py ]; then
        step ddp "${GPU_CHECK_DDP_TIMEOUT:-35}" \
            "$PY" scripts/bench_ddp.py --nranks 1 --caps 1,25 --steps 10 --timeout 45 --png "" \
            --csv "$WORK/ddp.csv"
        [ -f "$WORK/ddp.csv" ] && cp "$WORK/ddp.csv" "$RES/ddp.csv"
    else
        skip ddp "scripts/bench_ddp.py not found"
    fi
fi

# -- summary (printed last) -------------------------------------------------------------------
"$PY" - "$WORK" "$RES" <<'EOF' | tee "$RES/summary.txt"
import csv, os, re, sys
work, res = sys.argv[1], sys.argv[2]
env = dict(l.split("=", 1) for l in open(os.path.join(work, "env")).read().splitlines() if "=" in l)
steps = [l.split() for l in open(os.path.join(work, "steps")).read().splitlines() if l.strip()]

def rows(name):
    path = os.path.join(res, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []

def fnum(v, spec):
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return "-"

print("=" * 78)
print("GPU CHECK SUMMARY")
if env.get("gpus", "0") == "0":
    print("GPU      NONE: CuPy sees no CUDA device (gpu tests skipped, benchmarks not run)")
else:
    print(f"GPU      {env.get('gpu')}  ({env.get('memory_gib')} GiB, sm_{env.get('sm')}, "
          f"{env.get('sms')} SMs)")
print(f"versions cuda driver/runtime {env.get('driver', '?')}/{env.get('runtime', '?')}  "
      f"cupy {env.get('cupy', '?')}  nccl {env.get('nccl', '?')}  torch {env.get('torch', '?')}  "
      f"jax {env.get('jax', '?')}  python {env.get('python', '?')}")
probe = env.get("probe", "not run (no GPU, or the environment step failed: see log.txt)")
print(f"probe    RawKernel compile+launch: {probe}; kernel cache {env.get('kernel_cache', '?')}")
print("steps    " + "  ".join(
    f"{n}={'ok' if rc == '0' else 'skipped' if rc == 'skipped' else 'TIMEOUT' if rc in ('124', '137') else 'FAILED(rc ' + rc + ')'}"
    f"{'' if rc == 'skipped' else ' ' + sec + 's'}" for n, rc, sec in steps))
tail = ""
p = os.path.join(res, "pytest.txt")
if os.path.exists(p):
    lines = [l for l in open(p).read().splitlines()
             if re.search(r"\d+ (passed|failed|skipped|error|errors|deselected)|no tests ran", l)]
    tail = lines[-1].strip("= ") if lines else "no result line (crashed or timed out)"
print(f"tests    pytest -m gpu: {tail}")
failed = [l.split(" ", 1)[1] for l in open(p).read().splitlines()
          if l.startswith(("FAILED ", "ERROR "))] if os.path.exists(p) else []
for f in failed[:8]:
    print(f"  FAILED {f[:110]}")
k = rows("kernels.csv")
if k:
    print("kernels  GB/s (bytes read+written) and ratio to a same-size D2D copy, 25 MiB buckets:")
    for op in ("pack", "unpack"):
        for pair in ("f32", "f32-bf16"):
            sel = [r for r in k if r["op"] == op and r["pair"] == pair and r["MiB"] == "25"]
            if sel:
                cells = "  ".join(f"x{r['tensors']}: {fnum(r['kernel_GBps'], '.0f')} "
                                  f"({fnum(r['ratio'], '.2f')})" for r in sel)
                print(f"  {op:6s} {pair:8s} {cells}  copy {fnum(sel[0]['copy_GBps'], '.0f')}  "
                      f"naive x{sel[-1]['tensors']} {fnum(sel[-1]['naive_GBps'], '.1f')}  "
                      f"host/call {fnum(sel[-1]['call_us'], '.0f')} us")
    big = [r for r in k if r["MiB"] == "100" and r["op"] == "pack" and r["pair"] == "f32"]
    if big:
        print("  pack f32 100 MiB: " + "  ".join(
            f"x{r['tensors']}: {fnum(r['kernel_GBps'], '.0f')} ({fnum(r['ratio'], '.2f')})" for r in big))
c = [r for r in rows("chunks.csv") if r["pair"] == "f32" and r["MiB"] == "25"]
if c:
    for op in ("pack", "unpack"):
        for n in sorted({r["tensors"] for r in c}, key=int):
            cells = "  ".join(f"{r['fixed_B']}: {fnum(r['ratio'], '.2f')}"
                              for r in c if r["op"] == op and r["tensors"] == n)
            print(f"chunks   {op} f32 25 MiB x{n}, ratio by chunk bytes: {cells}")
for name in ("allreduce.csv", "ddp.csv"):
    r = rows(name)
    if r:
        cols = list(r[0])[:10]
        print(f"{name[:-4]:8s} {len(r)} rows; last: " +
              ", ".join(f"{c}={r[-1][c]}" for c in cols))
print(f"files    {res}: {', '.join(sorted(os.listdir(res)))}")
print("=" * 78)
EOF

if [ "$GPUS" = "0" ]; then
    exit 2
fi
if awk '$2 != "0" && $2 != "skipped" {bad = 1} END {exit !bad}' "$WORK/steps"; then
    exit 1
fi
exit 0
