"""The chaos soak's CI version on moto (issue 28): tests/test_soak.py's 40 seeded faults, every kind at
least twice, the S3 kinds among them (puts denied, a reply lost after the write committed), over one run
in a bucket."""

from __future__ import annotations

import pytest
from test_soak import soak

pytestmark = pytest.mark.slow


def test_40_seeded_faults_on_moto_break_no_invariant(tmp_path):
    soak("s3", tmp_path / "soak")
