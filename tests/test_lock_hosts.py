"""A run lock that cannot be checked from here (another machine) is refused, never taken over; one of this
host name under an older boot id is this machine before a reboot: its trainer is gone, so it is taken over.

The locks are real ones (written by the lock code for a process of this test), then edited the way a
lock from elsewhere would differ: only the documented identity fields (host, boot id)."""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import TINY, andrea

from andrea_core.run import lock
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import LOCK, RunDir


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


def test_a_lock_from_another_machine_is_refused_not_taken_over(trained):
    run = trained
    # A lock without a lease (written before leases): nothing says when its holder is gone.
    held = lock_from_elsewhere(
        run, host="gpu-box-7", boot_id=str(uuid.UUID(int=7)), lease_ttl_s=None, lease_renew_s=None
    )
    history = read_history(RunDir(str(run)))
    try:
        proc = andrea("train", "--run-dir", str(run), "--max-steps", "20", check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("andrea: error: ") and "host gpu-box-7" in proc.stderr
        assert "cannot be checked from here" in proc.stderr
        assert "taking over" not in proc.stdout + proc.stderr
        assert (run / LOCK).read_bytes() == held, "the lock is left as it was"
        assert RunDir(str(run)).checkpoint_steps() == [10] and read_history(RunDir(str(run))) == history
    finally:
        (run / LOCK).unlink(missing_ok=True)


def test_a_lock_from_before_a_reboot_of_this_host_is_taken_over(tmp_path):
    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "10")
    lock_from_elsewhere(run, boot_id=str(uuid.UUID(int=7)))  # this host name, an older boot
    proc = andrea("train", "--run-dir", str(run), "--max-steps", "20")
    out = proc.stdout + proc.stderr
    assert "taking over the stale lock" in out and "this machine has rebooted since" in out
    assert read_history(RunDir(str(run)))[-1].step == 20
    assert RunDir(str(run)).checkpoint_steps()[-1] == 20
    left = json.loads((run / LOCK).read_text())
    assert left["released"] and left["generation"] == 3, "taken over (2), then released by the new trainer"
