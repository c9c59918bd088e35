#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (the slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
mkdir -p "$PREFECT_HOME"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
