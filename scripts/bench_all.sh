#!/usr/bin/env bash
# Regenerate the tables and pictures of docs/benchmarks.md in one run (issue 37).
#   bash scripts/bench_all.sh [--quick] [--out DIR] [--only name1,name2] [--dry-run]
# Each table runs its scripts/bench_*.py in the venv it needs (.venv, .venv-tf, .venv-paddle,
# .venv-ms; a table whose venv is missing is skipped, saying so), with this tree first on the path.
# Writes DIR (default out/bench_all/<UTC date-time>): per table NAME.txt (the script's output),
# its CSV/PNG, and summary.md: per table the command, the 1-minute load average before and after,
# the cores other processes kept busy in 3 s before and after (marked when >= 0.5: figures to rerun
# on a quiet machine; the load average also counts our own ranks), the exit status, the time taken, and
# the markdown tables ready to paste. --quick: tiny sizes, every table once end to end (a check
# that the full run will not fail, figures meaningless). --dry-run: print each table's name,
# python and arguments (tab-separated), run nothing. Full run: about 15 minutes on 2 quiet cores.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=0
dry=0
out=""
only=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --quick) quick=1 ;;
    --dry-run) dry=1 ;;
    --out) out=$2; shift ;;
    --only) only=$2; shift ;;
    *) echo "bench_all.sh: unknown argument $1 (use --quick, --out DIR, --only a,b, --dry-run)" >&2; exit 2 ;;
  esac
  shift
done
out=${out:-out/bench_all/$(date -u +%Y%m%d-%H%M%S)}
[[ $dry == 1 ]] || mkdir -p "$out"
summary=$out/summary.md
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_DDP_BENCH_MARKDOWN=1 NCCL_DDP_NO_PROGRESS=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
BUSY=0.5  # cores other processes may keep busy around a table before it is marked loaded
start_all=$(date +%s)
loaded_tables=()
failed_tables=()

load1() { cut -d' ' -f1 /proc/loadavg; }

# busy: how many cores other processes keep busy, over 3 s while no benchmark of ours runs (from
# /proc/stat; the 1-minute load average still counts the previous table's own ranks for minutes)
cpu_ticks() { awk '/^cpu /{ print $2+$3+$4+$5+$6+$7+$8+$9, $5+$6 }' /proc/stat; }
busy() {
  local a b
  a=$(cpu_ticks); sleep 3; b=$(cpu_ticks)
  awk -v a="$a" -v b="$b" -v n="$(getconf _NPROCESSORS_ONLN)" 'BEGIN {
    split(a, x, " "); split(b, y, " "); t = y[1] - x[1]; i = y[2] - x[2]
    printf "%.2f", (t > 0 ? (t - i) / t * n : 0) }'
}

[[ $dry == 1 ]] || {
  echo "# Benchmarks, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null)$([[ $quick == 1 ]] && echo ', QUICK MODE (sizes too small to mean anything)')"
  echo
  echo "$(getconf _NPROCESSORS_ONLN) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(free -g | awk '/Mem:/{print $2}') GiB;" \
    "$(.venv/bin/python -c 'import sys, numpy, torch; print(f"Python {sys.version.split()[0]}, NumPy {numpy.__version__}, torch {torch.__version__}")' 2>/dev/null)"
  echo
} >"$summary"

# table NAME PYTHON TIMEOUT_S SCRIPT ARGS...: run one benchmark, append its tables to the summary
table() {
  local name=$1 py=$2 limit=$3
  shift 3
  if [[ -n $only && ",$only," != *",$name,"* ]]; then
    return
  fi
  if [[ $dry == 1 ]]; then
    printf '%s\t%s' "$name" "$py"  # (ENV_NOTE, when set, is not listed)
    printf '\t%s' "$@"
    printf '\n'
    return
  fi
  if [[ ! -x $py ]]; then
    printf '## %s\n\nskipped: %s is missing (scripts/setup_*_venv.sh makes it)\n\n' "$name" "$py" >>"$summary"
    echo "bench_all: $name skipped ($py missing)"
    return
  fi
  local before after t0 t1 rc mark="" busy_before busy_after
  busy_before=$(busy)
  before=$(load1)
  t0=$(date +%s)
  echo "bench_all: $name ($py $*) ..."
  timeout "$limit" "$py" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  t1=$(date +%s)
  after=$(load1)
  busy_after=$(busy)
  if awk -v a="$busy_before" -v b="$busy_after" -v l="$BUSY" 'BEGIN { exit !(a >= l || b >= l) }'; then
    mark=" **LOADED (other processes kept >= $BUSY cores busy): rerun on a quiet machine**"
    loaded_tables+=("$name")
  fi
  [[ $rc == 0 ]] || failed_tables+=("$name (exit $rc$([[ $rc == 124 ]] && echo ", timed out after ${limit}s"))")
  {
    printf '## %s\n\n`%s%s %s`\n\n' "$name" "${ENV_NOTE:+$ENV_NOTE }" "$py" "$*"
    printf 'load average before %s, after %s (counts our own ranks); cores busy with other processes before %s, after %s%s; exit %s; %ss\n\n' \
      "$before" "$after" "$busy_before" "$busy_after" "$mark" "$rc" "$((t1 - t0))"
    # the tables and the scripts' own comment lines, without the launcher's rank prefix
    sed -E 's/^\[rank [0-9]+\] //' "$out/$name.txt" | grep -E '^(\||# )' || echo "(no table: see $name.txt)"
    echo
  } >>"$summary"
  echo "bench_all: $name exit $rc, $((t1 - t0)) s, load $before -> $after, others busy $busy_before / $busy_after cores"
}

P=.venv/bin/python
if [[ $quick == 1 ]]; then
  table allreduce_2ranks $P 300 scripts/bench_allreduce.py --min 1K --max 2M --iters 3 --warmup 1 --limit-min 1M \
    --csv "$out/allreduce_2ranks.csv" --png "$out/allreduce_2ranks.png"
  table allreduce_3ranks $P 300 scripts/bench_allreduce.py --nranks 3 --min 1M --max 2M --iters 3 --warmup 1 --no-gloo \
    --csv "$out/allreduce_3ranks.csv" --png "$out/allreduce_3ranks.png"
  ENV_NOTE=NCCL_DDP_HOST_CHUNK_BYTES=524288 NCCL_DDP_HOST_CHUNK_BYTES=524288 \
    table allreduce_2ranks_chunk512k $P 300 scripts/bench_allreduce.py --min 1M --max 2M --iters 3 --warmup 1 \
    --limit-min 1M --no-gloo --csv "$out/allreduce_2ranks_chunk512k.csv" --png ""
  # 2 nodes x 2 ranks on this machine: the hierarchical all-reduce against the flat ring, links
  # between the nodes paced to 100 MB/s (gloo's are not)
  ENV_NOTE=NCCL_DDP_HOST_THROTTLE_BPS=100000000 NCCL_DDP_HOST_THROTTLE_BPS=100000000 \
    table allreduce_2nodes_throttled $P 300 scripts/bench_allreduce.py --nranks 4 --nodes 2 --min 1M --max 1M \
    --iters 3 --warmup 1 --limit-min 0 --csv "$out/allreduce_2nodes_throttled.csv" --png ""
  table ddp_mlp $P 300 scripts/bench_ddp.py --torch --caps 1 --hidden 128 --layers 2 --steps 2 --warmup 1 \
    --profile-steps 1 --csv "$out/ddp_mlp.csv" --png "$out/ddp_mlp.png"
  table ddp_12m $P 300 scripts/bench_ddp.py --modes torch --caps 1,25 --features 200 --hidden 200 --layers 2 \
    --steps 2 --warmup 1 --profile-steps 1 --csv "$out/ddp_12m.csv" --png "$out/ddp_12m.png"
  table ddp_params $P 300 scripts/bench_ddp.py --many-params --linears 20 --rounds 3 \
    --params-csv "$out/ddp_params.csv" --params-png "$out/ddp_params.png"
  table hooks $P 300 scripts/bench_ddp.py --modes torch --hook allreduce,bf16 --caps 25 --hidden 64 --layers 2 \
    --steps 2 --warmup 1 --profile-steps 1 --csv "$out/hooks.csv" --png ""
  table find_unused $P 300 scripts/bench_ddp.py --many-params --find-unused --worlds 2 --linears 20 --rounds 3 \
    --params-csv "$out/find_unused.csv" --params-png ""
  table fsdp $P 300 scripts/bench_fsdp.py --worlds 2 --layers 2 --dim 64 --vocab 128 --seq 16 --steps 1 --warmup 1 \
    --csv "$out/fsdp.csv"
  table zero $P 600 scripts/bench_zero.py --worlds 2 --hidden 256 --layers 2 --steps 1 --warmup 1 \
    --profile-steps 1 --modes ddp_adamw,zero2,torch_zero --csv "$out/zero.csv"
  table jax_jit $P 300 scripts/bench_jax_jit.py --models small --steps 2 --rounds 1 --warmup 1 --csv "$out/jax_jit.csv"
  table tf .venv-tf/bin/python 300 scripts/bench_tf.py --models small --steps 2 --rounds 1 --warmup 1
  table tf_mwms .venv-tf/bin/python 300 scripts/bench_tf.py --mode mwms --models small --steps 2 --rounds 1 --warmup 1
  table paddle .venv-paddle/bin/python 300 scripts/bench_paddle.py --steps 3 --rounds 1 --warmup 1 --csv "$out/paddle.csv"
  table mindspore .venv-ms/bin/python 300 scripts/bench_ms_graph.py --models lenet --steps 2 --rounds 1 --warmup 1 \
    --csv "$out/mindspore.csv"
  table horovod $P 300 scripts/bench_horovod.py --steps 3 --rounds 1 --warmup 1 --csv "$out/horovod.csv"
  table startup $P 600 scripts/bench_startup.py --repeats 1 --csv "$out/startup.csv"
else
  table allreduce_2ranks $P 300 scripts/bench_allreduce.py --csv "$out/allreduce_2ranks.csv" --png "$out/allreduce_2ranks.png"
  table allreduce_3ranks $P 300 scripts/bench_allreduce.py --nranks 3 --min 16M --max 256M \
    --csv "$out/allreduce_3ranks.csv" --png "$out/allreduce_3ranks.png"
  # the shm chunk size against the default (2 MiB): smaller chunks keep the staging copies in
  # cache at the price of more signals; which wins is for a quiet machine to say
  ENV_NOTE=NCCL_DDP_HOST_CHUNK_BYTES=524288 NCCL_DDP_HOST_CHUNK_BYTES=524288 \
    table allreduce_2ranks_chunk512k $P 300 scripts/bench_allreduce.py --min 16M --max 256M --no-gloo \
    --csv "$out/allreduce_2ranks_chunk512k.csv" --png ""
  # 2 nodes x 2 ranks on this machine (GROUP_RANK per rank): hierarchical vs the flat ring vs gloo,
  # unpaced, then with our links between the nodes paced to 100 MB/s (gloo's are not: no tc here)
  table allreduce_2nodes $P 400 scripts/bench_allreduce.py --nranks 4 --nodes 2 --min 16M --max 64M \
    --limit-min 0 --csv "$out/allreduce_2nodes.csv" --png ""
  ENV_NOTE=NCCL_DDP_HOST_THROTTLE_BPS=100000000 NCCL_DDP_HOST_THROTTLE_BPS=100000000 \
    table allreduce_2nodes_throttled $P 400 scripts/bench_allreduce.py --nranks 4 --nodes 2 --min 25M --max 25M \
    --limit-min 0 --csv "$out/allreduce_2nodes_throttled.csv" --png ""
  table ddp_mlp $P 300 scripts/bench_ddp.py --torch --steps 10 --csv "$out/ddp_mlp.csv" --png "$out/ddp_mlp.png"
  table ddp_12m $P 400 scripts/bench_ddp.py --modes torch --caps 1,4,25 --features 1400 --hidden 1400 --layers 6 \
    --steps 1 --step-rounds 15 --profile-steps 5 --csv "$out/ddp_12m.csv" --png "$out/ddp_12m.png"
  table ddp_params $P 300 scripts/bench_ddp.py --many-params --params-csv "$out/ddp_params.csv" \
    --params-png "$out/ddp_params.png"
  table hooks $P 300 scripts/bench_ddp.py --modes torch --hook allreduce,bf16,fp16,powersgd --caps 25 --hidden 256 \
    --layers 3 --steps 20 --csv "$out/hooks.csv" --png "$out/hooks.png"
  table find_unused $P 300 scripts/bench_ddp.py --many-params --find-unused --worlds 2 --rounds 20 \
    --params-csv "$out/find_unused.csv" --params-png ""
  # ZeRO-3: ours against torch's fully_shard (gloo) on torch's test Transformer, 3 jobs per mode
  table fsdp $P 900 scripts/bench_fsdp.py --worlds 2,4 --rounds 3 --csv "$out/fsdp.csv"
  table zero $P 600 scripts/bench_zero.py --worlds 2 --modes ddp_adamw,zero2,torch_zero --rounds 3 \
    --csv "$out/zero.csv"
  table jax_jit $P 300 scripts/bench_jax_jit.py --steps 10 --rounds 5 --csv "$out/jax_jit.csv"
  table tf .venv-tf/bin/python 300 scripts/bench_tf.py --rounds 5 --steps 10
  table tf_mwms .venv-tf/bin/python 300 scripts/bench_tf.py --mode mwms --rounds 5 --steps 10
  table paddle .venv-paddle/bin/python 300 scripts/bench_paddle.py --rounds 9 --steps 30 --csv "$out/paddle.csv"
  table mindspore .venv-ms/bin/python 300 scripts/bench_ms_graph.py --steps 10 --rounds 3 --csv "$out/mindspore.csv"
  table horovod $P 300 scripts/bench_horovod.py --rounds 9 --steps 30 --csv "$out/horovod.csv"
  table startup $P 600 scripts/bench_startup.py --repeats 2 --csv "$out/startup.csv"
fi

[[ $dry == 1 ]] && exit 0
total=$(($(date +%s) - start_all))
{
  echo "Total: ${total}s."
  [[ ${#loaded_tables[@]} -gt 0 ]] && echo "Measured beside other processes (>= $BUSY cores busy): ${loaded_tables[*]}."
  [[ ${#failed_tables[@]} -gt 0 ]] && echo "Failed: ${failed_tables[*]}."
} >>"$summary"
echo "bench_all: done in ${total}s; summary in $summary"
[[ ${#loaded_tables[@]} -gt 0 ]] && echo "bench_all: other processes kept >= $BUSY cores busy around: ${loaded_tables[*]} (rerun those on a quiet machine)"
if [[ ${#failed_tables[@]} -gt 0 ]]; then
  echo "bench_all: FAILED: ${failed_tables[*]}" >&2
  exit 1
fi
exit 0
