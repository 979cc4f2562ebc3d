#!/usr/bin/env bash
# Set up a virtual environment and run the main job: a 2-process data-parallel training run of
# examples/train_mlp.py through nccl-ddp-run (NCCL + CuPy on GPUs; the host backend without one).
#   bash scripts/run_main_job.sh [--nproc-per-node N] [train_mlp.py args...]
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
extras=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
  [[ ${cuda_major:-12} -ge 13 ]] && extras="[cuda13]" || extras="[cuda12]"
fi
pip_install -e ".$extras"
nproc=2
if [[ ${1:-} == --nproc-per-node ]]; then nproc=$2; shift 2; fi
exec "$VENV/bin/nccl-ddp-run" --standalone --nproc-per-node "$nproc" examples/train_mlp.py "$@"
