#!/usr/bin/env bash
# Create/refresh ./.venv and run the main job on the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
