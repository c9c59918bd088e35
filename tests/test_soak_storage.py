"""The chaos soak's storage faults on moto (issue 48, item 3): bench/soak.py's five kinds of a store slow or
gone, twice each, over one run in a bucket, every process reaching moto through its host's endpoint of
tests/s3_relay.py. Zero violations, and each fault shown to have done what it claims: every dropped
CompleteMultipartUpload reply was a committed object, every partition ended in a takeover of the
still-running holder, the store did answer late and did answer 503."""

from __future__ import annotations

import re

import pytest
from test_soak import run_soak

pytestmark = pytest.mark.slow
STORAGE = ["s3-slow", "s3-503", "s3-hang", "s3-partition", "lost-complete"]
EACH = 2


def did(out: str, kind: str) -> dict[str, str]:
    """The soak's 'what the faults did' line of `kind`: name -> value."""
    m = re.search(rf"^  {kind}: (.*)$", out, re.M)
    assert m, (kind, out[-6000:])
    return dict(re.fullmatch(r"(.*) (\S+)", item).groups() for item in m.group(1).split(", "))


def test_storage_slow_throttled_hung_partitioned_and_lost_completes_break_no_invariant(tmp_path):
    returncode, out, table = run_soak("s3", STORAGE, EACH, tmp_path / "soak", timeout=1800)
    for kind in STORAGE:
        assert table[kind] == (str(EACH), str(EACH), "-"), (kind, out[-6000:])
    assert re.search(r"^violations: 0;", out, re.M) and returncode == 0, out[-6000:]
    lost = did(out, "lost-complete")
    assert int(lost["replies dropped"]) == int(lost["object there with the dropped reply's ETag"]) >= 1, lost
    part = did(out, "s3-partition")
    taken = sum(int(v) for k, v in part.items() if k.startswith("taken over ("))
    assert taken == EACH and int(part["requests cut off"]) > 0, part
    assert int(did(out, "s3-503")["503 answered"]) > 0
    assert int(did(out, "s3-slow")["requests delayed"]) > 0
    assert int(did(out, "s3-hang").get("seconds held", "0").split(".")[0]) > 0
