"""The chaos soak's CI version (issue 28): bench/soak.py's 40 seeded faults of every kind over one run, on
a tmpfs and on moto, with zero invariant violations (bench/README.md has the long soak's figures)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow
KINDS = {"local": 15, "s3": 16}  # bench/soak.py's KINDS: each is thrown at the run twice or more in 40


@pytest.mark.parametrize("store", ["local", "s3"])
def test_forty_seeded_faults_break_no_invariant(store, tmp_path):
    if store == "local" and os.geteuid() != 0:
        pytest.skip("the soak mounts a tmpfs of its own (needs root; CI runs as root)")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "soak.py"),
            "--faults",
            "40",
            "--seed",
            "1",
            "--store",
            store,
            "--work",
            str(tmp_path / "soak"),
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
        assert int(injected) >= 2 and survived == injected and violations == "-", (kind, out[-6000:])
    assert re.search(r"^violations: 0;", out, re.M), out[-6000:]
    assert proc.returncode == 0, out[-6000:]
