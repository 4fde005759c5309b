#!/usr/bin/env bash
# Create/refresh ./.venv and run the whole test suite (slow end-to-end tests included), in
# FINETUNE_TEST_WORKERS worker processes (default 2, a file's tests in one worker; 0: in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -n "${FINETUNE_TEST_WORKERS:-2}" --dist loadfile "$@"
