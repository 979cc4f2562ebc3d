#!/usr/bin/env bash
# torch's own FSDP2 tests (test/distributed/_composable/fsdp/test_fully_shard_training.py, not in
# the wheel) with torch's fully_shard and with ours, one test at a time, tabulated:
#   bash scripts/run_torch_fsdp_file.sh [PATH] [--who torch,ours] [--all | -k NAME ...] [--timeout S]
# PATH (default $NCCL_DDP_TORCH_FSDP_FILE): the file or a torch source checkout. By default only the
# tests tests/support/fsdp_torch_tests.py expects to pass with ours; --all for every one. The table
# goes to stdout and out/torch_fsdp_file/results.csv, each run's output to out/torch_fsdp_file/logs/.
# The driver is tests/support/torch_fsdp_file.py (--help for its options); docs/zero.md, ZeRO-3.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" tests/support/torch_fsdp_file.py "$@"
