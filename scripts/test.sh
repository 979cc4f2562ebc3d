#!/usr/bin/env bash
# Set up a virtual environment with the test extras and every framework we test, then check.
#   bash scripts/test.sh [--fast] [pytest args...]
# Stages: lint and format check (ruff), types (mypy), then pytest. --fast runs only the tests not marked `slow`
# (each under 2 s, setup included; pytest lists unmarked ones that take longer); without it, the
# whole suite. Environments (created once, reused): .venv (NumPy 2,
# torch CPU, JAX CPU, CuPy + NVRTC + NCCL wheels for the kernel compile checks), .venv-ms
# (MindSpore 2.10, which needs numpy<2; the MindSpore tests run their examples in it), .venv-tf
# (tensorflow-cpu 2.21 + Keras 3.15, ~100 s to install; the TensorFlow tests run their ranks in it)
# and .venv-paddle (PaddlePaddle 3.3 CPU and tinygrad, 30 s to 2 min to install; Paddle's tests run
# in it: TensorFlow and Paddle segfault in one process) and .venv-ray (Ray Train 2.60 with the same torch;
# its pins stay out of .venv).
# NCCL_DDP_SKIP_FRAMEWORKS=1 skips the framework installs (their tests then skip, saying why).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
fast=0
if [[ ${1:-} == --fast ]]; then
  fast=1
  shift
fi
pip_install -e ".[test,plot,lint]"
if [[ ${NCCL_DDP_SKIP_FRAMEWORKS:-0} != 1 ]]; then
  # torch 2.13.0 is a CPU wheel on local disk; a plain "torch" would fetch a CUDA build of several GB.
  # Lightning/Accelerate/optax/Keras (the test-frameworks extra) in the same call, so torch stays 2.13.0.
  pip_install "torch==2.13.0" jax jaxlib cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-nccl-cu12 \
    -e ".[test-frameworks]"
  if [[ -f scripts/setup_ms_venv.sh ]]; then
    bash scripts/setup_ms_venv.sh
  fi
  if [[ -f scripts/setup_tf_venv.sh ]]; then
    bash scripts/setup_tf_venv.sh
  fi
  if [[ -f scripts/setup_paddle_venv.sh ]]; then
    bash scripts/setup_paddle_venv.sh
  fi
  bash scripts/setup_ray_venv.sh  # Ray Train's TorchTrainer (about 3 min to install)
fi
echo "== lint and format (ruff)"
"$VENV/bin/ruff" check nccl_ddp tests scripts examples
"$VENV/bin/ruff" format --check nccl_ddp tests scripts examples
echo "== types (mypy)"
"$VENV/bin/mypy"
echo "== tests"
if ((fast)); then
  exec "$VENV/bin/python" -m pytest -m "not slow" "$@"
fi
exec "$VENV/bin/python" -m pytest "$@"
