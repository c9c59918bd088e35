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
# The version from torch's installed metadata (the same "2.13.0+cpu"): importing torch for it cost every
# run, a rerun included, about 5 s of CPU; the import itself is checked above, after each install.
echo "setup: ready ($(.venv/bin/python -c 'import importlib.metadata as m; print("torch", m.version("torch"))'))"
