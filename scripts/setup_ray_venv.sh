#!/usr/bin/env bash
# Create (or reuse) the Ray venv that tests/adapters/torch_tests/integrations/test_ray_train.py runs its job in: Ray Train's
# TorchTrainer on a local Ray cluster (2 CPU workers). Ray lives apart from the main venv: its wheels
# pin their own ranges (protobuf, grpcio, pydantic...). torch is the CPU wheel the main venv tests
# (2.13.0), so the comparison with torch DDP is the same torch. Idempotent: a venv that already
# imports the pinned versions is left alone except for the editable install of this checkout.
#
# Usage: scripts/setup_ray_venv.sh [VENV_DIR]     (default: .venv-ray in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${NCCL_DDP_RAY_VENV:-$ROOT/.venv-ray}}"
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_ray_venv: creating $VENV"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import ray.train.torch, torch, numpy, pytest, pytest_timeout; \
assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__" >/dev/null 2>&1; then
    echo "setup_ray_venv: ray[train] and torch $TORCH_VERSION already installed in $VENV"
else
    echo "setup_ray_venv: installing ray[train] and torch $TORCH_VERSION into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "torch==$TORCH_VERSION" "ray[train]>=2.40,<2.61" numpy pytest pytest-timeout
fi

# --no-deps: numpy and torch are already there; never let the editable install change them.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import ray, torch, numpy, nccl_ddp; \
print('setup_ray_venv: ok: ray', ray.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
