#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (the slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/pins.sh
# The MLflow tracking server tests/test_mlflow.py starts: a venv of its own (mlflow 3.17 wants
# pyarrow<26; the product itself speaks MLflow's REST API through httpx and needs no mlflow).
# ANDREA_SKIP_MLFLOW_SERVER=1 leaves it out (tests/test_mlflow.py then fails, naming it).
# Installed in the background while scripts/setup.sh installs .venv: each pip run unpacks and compiles on
# one core, so the two together fill both. Its output is held in a file and printed once both are done;
# a failure of either stops the run, each named.
mlflow_stamp=.venv-mlflow/.andrea-installed
install_mlflow() {
  [ -x .venv-mlflow/bin/python ] || "$PYTHON" -m venv .venv-mlflow || return 1
  pinned_install .venv-mlflow/bin/python -r tests/mlflow-server.txt || true  # scripts/pins.sh
  # Its imports compiled into the venv once, as setup.sh does for .venv (pins.sh installs no bytecode).
  env -u PYTHONDONTWRITEBYTECODE .venv-mlflow/bin/python -c "import mlflow.server" || return 1
  cp tests/mlflow-server.txt "$mlflow_stamp"
}
mlflow_pid=
if [ "${ANDREA_SKIP_MLFLOW_SERVER:-0}" != 1 ] && { [ ! -f "$mlflow_stamp" ] || ! cmp -s tests/mlflow-server.txt "$mlflow_stamp"; }; then
  echo "test: installing the MLflow tracking server the tests use (.venv-mlflow, tests/mlflow-server.txt), in the background"
  mlflow_log=$(mktemp)
  install_mlflow >"$mlflow_log" 2>&1 &
  mlflow_pid=$!
fi
setup_rc=0 mlflow_rc=0
bash scripts/setup.sh || setup_rc=$?
if [ -n "$mlflow_pid" ]; then
  wait "$mlflow_pid" || mlflow_rc=$?
  cat "$mlflow_log"
  rm -f "$mlflow_log"
  [ "$mlflow_rc" != 0 ] || echo "test: MLflow tracking server ready (.venv-mlflow)"
fi
[ "$setup_rc" = 0 ] || echo "test: scripts/setup.sh failed (exit $setup_rc): .venv is not ready" >&2
[ "$mlflow_rc" = 0 ] || echo "test: the MLflow server failed to install or import (.venv-mlflow, tests/mlflow-server.txt)" >&2
[ "$setup_rc" = 0 ] && [ "$mlflow_rc" = 0 ] || exit 1
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
# Every process the suite starts imports andrea_core, the tests' helpers and torch: their bytecode is
# cached in __pycache__ (ignored by git) whatever the caller's environment says, not compiled anew by
# each of the suite's few hundred cold starts.
unset PYTHONDONTWRITEBYTECODE
mkdir -p "$PREFECT_HOME"
# Programs some tests need, from Debian's packages where missing, once: the Prefect UI test drives a
# headless Chromium, the systemd unit test runs systemd-analyze, the pid-namespace lock test unshare(1),
# the soak's power-cut layer (bench/powercut.py, tests/test_powercut.py) FUSE through libfuse2, its clock
# faults (bench/clockshim.c, an LD_PRELOAD library) a C compiler.
# A test whose program is still missing is skipped, and named with its reason in the banner pytest prints
# at the end (tests/conftest.py); a tmpfs for the full-disk tests needs CAP_SYS_ADMIN, which no package
# gives.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2 ' || missing+=(libfuse2)
command -v cc >/dev/null 2>&1 || missing+=(gcc)  # the soak's clock shim (bench/clockshim.c)
if [ ${#missing[@]} -gt 0 ]; then
  echo "test: installing ${missing[*]} for the tests that need them"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || echo "test: could not install ${missing[*]}; the tests needing them fail or skip, saying so" >&2
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Three workers on two cores, each running whole modules (a module's server and fixtures stay in one
# process): the tests' trainers use one thread each, and a module spends part of its time waiting (a
# server starting, a lease's ttl, a trainer's first step), which a third worker fills. Modules go out in
# collection order, slowest first (tests/module_times.txt), not by their count of tests.
# ANDREA_TEST_WORKERS=N for another number; 0 runs them in this process, one after another.
# At the end each module's wall and CPU seconds are printed, slowest first, the wall seconds merged into
# tests/module_times.txt, from which the next run's order is taken; each test's CPU seconds go to
# test-output/test-cpu.txt (tests/conftest.py).
workers="${ANDREA_TEST_WORKERS:-3}"
export ANDREA_MODULE_TIMES="${ANDREA_MODULE_TIMES:-$PWD/tests/module_times.txt}"
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
