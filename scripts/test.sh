#!/usr/bin/env bash
# Set up a virtual environment with the test extras and every framework we test, then run the suite.
#   bash scripts/test.sh [pytest args...]
# Environments (created once, reused): .venv (NumPy 2, torch CPU, JAX CPU, CuPy + NVRTC + NCCL wheels
# for the kernel compile checks) and .venv-ms (MindSpore 2.10, which needs numpy<2; the MindSpore
# tests run their examples in it). NCCL_DDP_SKIP_FRAMEWORKS=1 skips the framework installs.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
pip_install -e ".[test,plot]"
if [[ ${NCCL_DDP_SKIP_FRAMEWORKS:-0} != 1 ]]; then
  # torch 2.13.0 is a CPU wheel on local disk; a plain "torch" would fetch a CUDA build of several GB.
  pip_install "torch==2.13.0" jax jaxlib cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-nccl-cu12
  if [[ -f scripts/setup_ms_venv.sh ]]; then
    bash scripts/setup_ms_venv.sh
  fi
fi
exec "$VENV/bin/python" -m pytest "$@"
