#!/usr/bin/env bash
# Create .venv at the repository root when missing and install the pinned dependencies and the
# `andrea` package (editable). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/pins.sh
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.andrea-installed
if [ ! -f "$stamp" ] || ! cat requirements.txt constraints.txt | cmp -s - "$stamp"; then
  echo "setup: installing pinned dependencies (requirements.txt, their own dependencies: constraints.txt)"
  # From the wheelhouse of these pins, filled the first time, and no bytecode compiled (scripts/pins.sh):
  # pip would compile every file of every package (about 35 s of a fresh setup's 83, on one core), most
  # of which no process imports. The import check below compiles what every andrea process imports,
  # once, into .venv (whatever PYTHONDONTWRITEBYTECODE says); anything else its first import compiles.
  pinned_install .venv/bin/python -r requirements.txt -c constraints.txt || true
  editable_install .venv/bin/python
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import torch, prefect, fsspec, yaml, numpy, s3fs
import andrea_core.cli, andrea_core.train.trainer, flows.train, flows.pivot, flows.audit_fork" \
    || { echo "setup: dependencies failed to import" >&2; exit 1; }
  cat requirements.txt constraints.txt > "$stamp"
fi
# The version from torch's installed metadata (the same "2.13.0+cpu"): importing torch for it cost every
# run, a rerun included, about 5 s of CPU; the import itself is checked above, after each install.
echo "setup: ready ($(.venv/bin/python -c 'import importlib.metadata as m; print("torch", m.version("torch"))'))"
