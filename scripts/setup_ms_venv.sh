#!/usr/bin/env bash
# Create (or reuse) the MindSpore venv that tests/adapters/mindspore_tests/test_mindspore_adapter.py and examples/ms_* run in.
# MindSpore 2.10 was built against NumPy 1.x, so it lives apart from the system Python (NumPy 2):
# numpy<2 and ml_dtypes<0.5 here. Idempotent: a venv that already imports mindspore is left alone
# except for the editable install of this checkout (cheap), so CI can call it every run.
#
# Usage: scripts/setup_ms_venv.sh [VENV_DIR]     (default: .venv-ms in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${NCCL_DDP_MS_VENV:-$ROOT/.venv-ms}}"
PY="${PYTHON:-python3}"
MS_VERSION="${MS_VERSION:-2.10.0}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_ms_venv: creating $VENV"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import mindspore, numpy, pytest, pytest_timeout; \
assert mindspore.__version__ == '$MS_VERSION', mindspore.__version__; \
assert int(numpy.__version__.split('.')[0]) < 2" >/dev/null 2>&1; then
    echo "setup_ms_venv: mindspore $MS_VERSION already installed in $VENV"
else
    echo "setup_ms_venv: installing mindspore $MS_VERSION (an ~800 MB wheel) into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "numpy<2" "ml_dtypes<0.5" "mindspore==$MS_VERSION" pytest pytest-timeout
fi

# --no-deps: numpy<2 is already there; never let the editable install upgrade it.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import mindspore, numpy, nccl_ddp; \
print('setup_ms_venv: ok: mindspore', mindspore.__version__, 'numpy', numpy.__version__)"
