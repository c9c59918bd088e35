"""The chaos soak's CI version on moto (issue 28, issue 45.5): tests/test_soak.py's seeded round, every
kind once (19), the S3 kinds among them (puts denied, a reply lost after the write committed) and the
features under chaos (a guard rollback, a pivot from the other host, a data folder changed), over one run
in a bucket."""

from __future__ import annotations

import pytest
from test_soak import soak

pytestmark = pytest.mark.slow


def test_a_seeded_fault_of_every_kind_on_moto_breaks_no_invariant(tmp_path):
    soak("s3", tmp_path / "soak")
