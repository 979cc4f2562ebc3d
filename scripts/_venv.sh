# Sourced by scripts/test.sh and scripts/run_main_job.sh: cd to the repository root, create (once)
# the virtual environment $VENV (default .venv, or $NCCL_DDP_VENV) and define pip_install.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${NCCL_DDP_VENV:-.venv}
if [[ ! -x $VENV/bin/python ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
