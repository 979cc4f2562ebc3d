#!/usr/bin/env bash
# Create (or reuse) the TensorFlow venv that tests/adapters/tensorflow_tests/test_tensorflow_adapter.py runs its ranks in.
# TensorFlow lives apart from the main venv: its wheels pin their own protobuf/ml_dtypes/numpy ranges,
# and it must never share a process with PaddlePaddle (importing both segfaults). Holds tensorflow-cpu,
# Keras 3, tf_keras (Keras 2, for the MultiWorkerMirroredStrategy comparison) and the test tools.
# Idempotent: a venv that already imports the pinned versions is left alone except for the editable
# install of this checkout (cheap), so CI can call it every run.
#
# Usage: scripts/setup_tf_venv.sh [VENV_DIR]     (default: .venv-tf in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${NCCL_DDP_TF_VENV:-$ROOT/.venv-tf}}"
PY="${PYTHON:-python3}"
TF_VERSION="${TF_VERSION:-2.21.0}"
KERAS_VERSION="${KERAS_VERSION:-3.15.1}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_tf_venv: creating $VENV"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import tensorflow as tf, keras, tf_keras, numpy, pytest, pytest_timeout; \
assert tf.__version__ == '$TF_VERSION', tf.__version__; \
assert keras.__version__ == '$KERAS_VERSION', keras.__version__" >/dev/null 2>&1; then
    echo "setup_tf_venv: tensorflow $TF_VERSION and keras $KERAS_VERSION already installed in $VENV"
else
    echo "setup_tf_venv: installing tensorflow-cpu $TF_VERSION (a ~250 MB wheel) and keras $KERAS_VERSION into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "tensorflow-cpu==$TF_VERSION" "keras==$KERAS_VERSION" "tf_keras~=${TF_VERSION%.*}.0" \
        numpy pytest pytest-timeout
fi

# --no-deps: numpy is TensorFlow's choice; never let the editable install change it.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; \
import tensorflow as tf, keras, numpy, nccl_ddp; \
print('setup_tf_venv: ok: tensorflow', tf.__version__, 'keras', keras.__version__, 'numpy', numpy.__version__)"
