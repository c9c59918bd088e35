"""A run lock that cannot be checked from here is refused, never taken over: one written on another host,
or on this host name under another boot (another machine of the same name, or this one before a reboot).

The locks are real ones (written by the lock code for a process of this test), then edited the way a
lock from elsewhere would differ: only the documented identity fields (host, boot id)."""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import TINY, andrea

from andrea_core import lock
from andrea_core.loss_log import read_history
from andrea_core.rundir import LOCK, RunDir


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("lock-hosts") / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "10")
    return run


def lock_from_elsewhere(run, **changes) -> bytes:
    """A lock of a live-looking trainer, written by the lock code, with `changes` to its identity."""
    rd = RunDir(str(run))
    me = lock.acquire(rd, log=lambda _: None)
    doc = json.loads((run / LOCK).read_text())
    assert me.host == doc["host"] and me.boot_id == doc["boot_id"]
    doc.update(changes)
    (run / LOCK).write_text(json.dumps(doc))
    return (run / LOCK).read_bytes()


@pytest.mark.parametrize(
    "where",
    [
        {"host": "gpu-box-7"},
        {"boot_id": str(uuid.UUID(int=7))},  # this host name, another boot
    ],
    ids=["another-host", "another-boot"],
)
def test_a_lock_that_cannot_be_checked_from_here_is_refused_not_taken_over(trained, where):
    run = trained
    held = lock_from_elsewhere(run, **where)
    host = json.loads(held)["host"]
    history = read_history(RunDir(str(run)))
    try:
        proc = andrea("train", "--run-dir", str(run), "--max-steps", "20", check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("andrea: error: ") and f"host {host}" in proc.stderr
        assert "taking over" not in proc.stdout + proc.stderr
        assert (run / LOCK).read_bytes() == held, "the lock is left as it was"
        assert RunDir(str(run)).checkpoint_steps() == [10] and read_history(RunDir(str(run))) == history
    finally:
        (run / LOCK).unlink(missing_ok=True)
