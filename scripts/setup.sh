#!/usr/bin/env bash
# Create .venv at the repository root when missing and install the pinned dependencies and the
# `andrea` package (editable). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.andrea-installed
if [ ! -f "$stamp" ] || ! cat requirements.txt constraints.txt | cmp -s - "$stamp"; then
  echo "setup: installing pinned dependencies (requirements.txt, their own dependencies: constraints.txt)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e . 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -c "import torch, prefect, fsspec, yaml, numpy" \
    || { echo "setup: dependencies failed to import" >&2; exit 1; }
  cat requirements.txt constraints.txt > "$stamp"
fi
# The MLflow tracking server tests/test_mlflow.py starts: a venv of its own (mlflow 3.17 wants
# pyarrow<26; the product itself speaks MLflow's REST API through httpx and needs no mlflow).
# ANDREA_SKIP_MLFLOW_SERVER=1 leaves it out (tests/test_mlflow.py then fails, naming it).
mlflow_stamp=.venv-mlflow/.andrea-installed
if [ "${ANDREA_SKIP_MLFLOW_SERVER:-0}" != 1 ] && { [ ! -f "$mlflow_stamp" ] || ! cmp -s tests/mlflow-server.txt "$mlflow_stamp"; }; then
  echo "setup: installing the MLflow tracking server the tests use (.venv-mlflow, tests/mlflow-server.txt)"
  [ -x .venv-mlflow/bin/python ] || "$PYTHON" -m venv .venv-mlflow
  .venv-mlflow/bin/python -m pip install --quiet --disable-pip-version-check -r tests/mlflow-server.txt 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv-mlflow/bin/python -c "import mlflow.server" \
    || { echo "setup: the MLflow server failed to import (.venv-mlflow)" >&2; exit 1; }
  cp tests/mlflow-server.txt "$mlflow_stamp"
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
