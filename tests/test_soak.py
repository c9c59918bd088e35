"""The chaos soak's CI version (issue 28): one round of bench/soak.py's seeded schedule, every fault kind
once, over one run on a tmpfs and on moto, with zero invariant violations. One round, not the issue's 40
faults: 40 take 206 s locally on an idle 2-core machine (2026-12-02), and in the suite the two stores'
40 would cost about five minutes more of one worker against the suite's 20-minute target (issue 30;
15:51 on 2026-12-04). The S3 round runs in every suite since the soak's relay stopped waiting on delayed
ACKs (87 s on 2026-12-04, 190 s before). The long soak (`--faults 1000`) and its figures are in
bench/README.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow
KINDS = {"local": 15, "s3": 16}  # bench/soak.py's KINDS: one round throws each at the run once


@pytest.mark.parametrize("store", ["local", "s3"])
def test_one_round_of_seeded_faults_of_every_kind_breaks_no_invariant(store, tmp_path):
    if store == "local" and os.geteuid() != 0:
        pytest.skip("the soak mounts a tmpfs of its own (needs root; CI runs as root)")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "soak.py"),
            "--faults",
            str(KINDS[store]),
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
        assert int(injected) >= 1 and survived == injected and violations == "-", (kind, out[-6000:])
    assert re.search(r"^violations: 0;", out, re.M), out[-6000:]
    assert proc.returncode == 0, out[-6000:]
