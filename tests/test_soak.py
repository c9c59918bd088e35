"""The chaos soak's CI version (issue 28): bench/soak.py's seeded schedule, 40 faults (every kind at least
twice; locally 42, the power-cut layer's six kinds of issue 48 included where FUSE mounts), over one run,
with zero invariant violations: on a tmpfs here (seen through bench/powercut.py), on moto in
tests/test_soak_s3.py.
Each store in a module of its own, so that the two go to the suite's two workers side by side (alone on
this machine: 178 s local, 222 s on moto, 2026-12-05). The long soak (`--faults 1000`) and its figures
are in bench/README.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow
sys.path.insert(0, str(REPO / "bench"))
from powercut import fuse_unavailable  # noqa: E402

# bench/soak.py's KINDS: locally 15, and the power-cut layer's 6 (power-cut, eio-write, eio-fsync,
# eio-read, short-write, bitrot) where FUSE mounts (issue 48)
NO_LAYER = fuse_unavailable()
KINDS = {"local": 15 if NO_LAYER else 21, "s3": 16}
FAULTS = {"local": 40 if NO_LAYER else 42, "s3": 40}  # every kind at least twice


def soak(store: str, work: Path) -> None:
    """bench/soak.py --faults FAULTS[store] --seed 1 on `store`: every kind injected and survived, 0
    violations."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "soak.py"),
            "--faults",
            str(FAULTS[store]),
            "--seed",
            "1",
            "--store",
            store,
            "--work",
            str(work),
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = proc.stdout + proc.stderr
    table = re.findall(r"^([a-z0-9-]+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+(.+)$", out, re.M)
    assert len(table) == KINDS[store], out[-6000:]
    for kind, injected, survived, violations in table:
        assert (
            int(injected) >= FAULTS[store] // KINDS[store] and survived == injected and violations == "-"
        ), (
            kind,
            out[-6000:],
        )
    assert sum(int(injected) for _, injected, _, _ in table) == FAULTS[store], out[-6000:]
    assert re.search(r"^violations: 0;", out, re.M), out[-6000:]
    assert proc.returncode == 0, out[-6000:]


def test_forty_seeded_faults_on_a_tmpfs_break_no_invariant(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the soak mounts a tmpfs of its own (needs root; CI runs as root)")
    soak("local", tmp_path / "soak")
