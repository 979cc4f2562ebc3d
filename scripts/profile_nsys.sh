#!/usr/bin/env bash
# Profile a training script under Nsight Systems, one report per rank, and print the overlap table.
#   bash scripts/profile_nsys.sh [-o DIR] [-n NPROC] script.py args...
# DIR (default ./nsys_profile) receives profile_rank<R>.nsys-rep, the .sqlite exports, and
# overlap.csv. NPROC goes to nccl-ddp-run --nproc-per-node (default auto: one rank per GPU).
#
# Layout: the launcher runs nsys, once per rank. nccl-ddp-run starts a small shim per rank (written
# into DIR) that execs `nsys profile ... python script.py args` in the worker's own process, so
# RANK is set when nsys expands %q{RANK} in the output name, and the launcher's signal forwarding
# and fail-fast still apply. (nsys around the launcher would also work, but puts all ranks into one
# report.) NCCL_DDP_NVTX=1 is exported so the reducer's phase ranges show up.
set -euo pipefail

OUT=./nsys_profile
NPROC=auto
while getopts "o:n:h" opt; do
  case $opt in
    o) OUT=$OPTARG ;;
    n) NPROC=$OPTARG ;;
    h) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "usage: $0 [-o DIR] [-n NPROC] script.py args..." >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [-o DIR] [-n NPROC] script.py args..." >&2
  exit 2
fi
if ! command -v nsys >/dev/null 2>&1; then
  echo "profile_nsys.sh: nsys (Nsight Systems CLI) is not on PATH. Install Nsight Systems" \
       "(https://developer.nvidia.com/nsight-systems) or add its bin/ directory to PATH." >&2
  exit 2
fi

HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if command -v nccl-ddp-run >/dev/null 2>&1; then
  LAUNCH=(nccl-ddp-run)
else
  LAUNCH=("$PY" -m nccl_ddp.launch)
fi

SHIM=$OUT/nsys_rank_shim.py
cat > "$SHIM" <<EOF
# Written by profile_nsys.sh: replaces this rank's process with nsys profiling the real script.
import os, sys
out = os.path.join(os.environ["NCCL_DDP_NSYS_DIR"], "profile_rank%q{RANK}")
os.execvp("nsys", ["nsys", "profile", "-t", "cuda,nvtx", "--capture-range=none",
                   "--force-overwrite=true", "-o", out, sys.executable, "-u"] + sys.argv[1:])
EOF

export NCCL_DDP_NVTX=1 NCCL_DDP_NSYS_DIR=$OUT
status=0
"${LAUNCH[@]}" --nproc-per-node "$NPROC" "$SHIM" "$@" || status=$?
if [[ $status -ne 0 ]]; then
  echo "profile_nsys.sh: the job failed (exit $status); exporting whatever reports exist" >&2
fi

shopt -s nullglob
reports=("$OUT"/profile_rank*.nsys-rep)
if [[ ${#reports[@]} -eq 0 ]]; then
  echo "profile_nsys.sh: no reports in $OUT" >&2
  exit 1
fi
exports=()
for rep in "${reports[@]}"; do
  db=${rep%.nsys-rep}.sqlite
  nsys export --type sqlite --force-overwrite true -o "$db" "$rep" >/dev/null
  exports+=("$db")
done
"$PY" "$HERE/overlap_report.py" "${exports[@]}" --csv "$OUT/overlap.csv"
exit "$status"
