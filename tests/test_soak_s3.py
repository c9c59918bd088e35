"""The chaos soak's CI version on moto (issue 28): one round of tests/test_soak.py's seeded faults, every
kind once, the S3 kinds among them (puts denied, a reply lost after the write committed), over one run in
a bucket (why one round, not 40: tests/test_soak.py's FAULTS)."""

from __future__ import annotations

import pytest
from test_soak import soak

pytestmark = pytest.mark.slow


def test_a_round_of_seeded_faults_on_moto_breaks_no_invariant(tmp_path):
    soak("s3", tmp_path / "soak")
