#!/usr/bin/env bash
# Create (or reuse) the PaddlePaddle venv that tests/adapters/test_paddle_adapter.py and
# examples/paddle_* run in. Paddle lives apart from the main venv: importing TensorFlow and Paddle
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

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_paddle_venv: creating $VENV"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import paddle, numpy, ml_dtypes, pytest, pytest_timeout; \
assert paddle.__version__ == '$PADDLE_VERSION', paddle.__version__" >/dev/null 2>&1; then
    echo "setup_paddle_venv: paddlepaddle $PADDLE_VERSION already installed in $VENV"
else
    echo "setup_paddle_venv: installing paddlepaddle $PADDLE_VERSION (CPU wheel, ~200 MB) into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "paddlepaddle==$PADDLE_VERSION" numpy ml_dtypes pytest pytest-timeout
fi

# --no-deps: the editable install must not pull or upgrade anything Paddle's wheel pinned.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import paddle, numpy, nccl_ddp; \
print('setup_paddle_venv: ok: paddlepaddle', paddle.__version__, 'numpy', numpy.__version__)"
