#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (the slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
mkdir -p "$PREFECT_HOME"
# The Prefect UI test drives a headless Chromium (Debian's package); install it once.
if ! command -v chromium >/dev/null 2>&1; then
  echo "test: installing chromium for the UI test"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "test: could not install chromium; the UI test will fail saying so" >&2
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
