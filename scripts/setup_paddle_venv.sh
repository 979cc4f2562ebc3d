#!/usr/bin/env bash
# Create (or reuse) the PaddlePaddle venv that tests/adapters/paddle_tests/test_paddle_adapter.py runs Paddle in,
# with tinygrad (pure Python, no dependencies) for examples/tinygrad_mlp.py and its test. Paddle lives apart from the main venv: importing TensorFlow and Paddle
# in one process segfaults, and its wheel pins its own protobuf/numpy ranges. Idempotent: a venv
# that already imports paddle at $PADDLE_VERSION is left alone except for the editable install of
# this checkout (cheap), so CI can call it every run.
#
# Usage: scripts/setup_paddle_venv.sh [VENV_DIR]     (default: .venv-paddle in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${NCCL_DDP_PADDLE_VENV:-$ROOT/.venv-paddle}}"
PY="${PYTHON:-python3}"
PADDLE_VERSION="${PADDLE_VERSION:-3.3.1}"
TINYGRAD_VERSION="${TINYGRAD_VERSION:-0.14.0}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_paddle_venv: creating $VENV"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import paddle, numpy, ml_dtypes, pytest, pytest_timeout; \
from importlib.metadata import version; \
assert paddle.__version__ == '$PADDLE_VERSION', paddle.__version__; \
assert version('tinygrad') == '$TINYGRAD_VERSION'" >/dev/null 2>&1; then
    echo "setup_paddle_venv: paddlepaddle $PADDLE_VERSION and tinygrad $TINYGRAD_VERSION already in $VENV"
else
    echo "setup_paddle_venv: installing paddlepaddle $PADDLE_VERSION (CPU wheel, ~200 MB) and tinygrad into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "paddlepaddle==$PADDLE_VERSION" "tinygrad==$TINYGRAD_VERSION" numpy ml_dtypes pytest pytest-timeout
fi

# --no-deps: the editable install must not pull or upgrade anything Paddle's wheel pinned.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import paddle, numpy, nccl_ddp; \
print('setup_paddle_venv: ok: paddlepaddle', paddle.__version__, 'numpy', numpy.__version__)"
