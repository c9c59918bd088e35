#!/usr/bin/env bash
# The embedded demo (flows/demo.py) on Prefect's ephemeral mode: no server to start. Trains andrea-tiny,
# pivots it to the polish policy at a checkpoint boundary, audit-forks the result into two branches
# and prints where the report and the plot are. About 2 1/4 minutes on an idle 2-core machine once .venv
# exists, plus about 4 minutes for the first install (docs/operations.md, "The demo").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_HOME="$PWD/.prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
# The ephemeral server starts inside this process: 17-30 s here, about the default 20 s timeout.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"
unset PREFECT_API_URL  # ephemeral mode: a server given here would take over
mkdir -p "$PREFECT_HOME"
exec .venv/bin/python -m flows.demo "$@"
