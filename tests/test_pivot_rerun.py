"""A rerun of a pivot that completed finds it done, however far the new phase has trained since (the chaos
soak's fault 363, issue 48): one request, one phase folder."""

from __future__ import annotations

import os
import signal
import socket

import pytest
from conftest import _env, andrea, last_logged_step, start_trainer, wait_for

from andrea_core.run.lineage import phases
from andrea_core.run.lock import live_trainer
from andrea_core.run.pivot_journal import PIVOT_JSON
from andrea_core.run.rundir import POLICY_YAML, RunDir
from tests.tiny import tiny_config


@pytest.mark.slow
def test_a_completed_pivot_rerun_after_the_new_phase_trained_is_done_once(tmp_path):
    """The soak's fault 363 (2026-12-06, local, seed 1): `andrea pivot --restart` from the other host
    completed (journal cleared, the resumed trainer training the new phase) and was SIGKILLed before it
    exited; the new phase trained 15 steps and the operator's rerun of the same command pivoted again:
    phase_028_step_011155 and phase_029_step_011170 for one request. Here the pivot is killed right
    after it completed, the resumed trainer writes a checkpoint of the new phase, and the rerun (with
    and without --restart) says the pivot is done, names the trainer, and changes nothing: one phase
    folder, the resumed trainer still the one training, policy.yaml and the archive as they were."""
    run_path = tmp_path / "run"
    run = RunDir(str(run_path))
    cfg = tiny_config(tmp_path, train__checkpoint_every=20)
    args = ["--run-dir", str(run_path), "--device", "cpu", "--max-steps", "100000", "--pace", "0.05"]
    first = start_trainer("--config", cfg, *args, log=tmp_path / "first.log")
    try:
        wait_for(lambda: last_logged_step(run) >= 25, 300, "step 25")
        argv = ["pivot", str(run_path), "--policy", "tiny-mix", "--timeout", "600"]
        killed = andrea(*argv, check=False, env={**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "finished"})
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        first.wait(120)
        (number, boundary), *more = phases(run)
        assert not more and not run.exists(PIVOT_JSON), killed.stdout
        resumed = live_trainer(run)
        assert resumed is not None and resumed.pid != first.pid, killed.stdout
        # The new phase trains on: a checkpoint of its own past the boundary, its bandit state written.
        wait_for(lambda: run.checkpoint_steps()[-1] > boundary, 300, "a checkpoint of the new phase")
        archive, policy = sorted(run.listdir("archive")), run.read_bytes(POLICY_YAML)
        for again in (argv, [*argv, "--no-restart"]):
            out = andrea(*again).stdout
            assert f"pivoted {run.url} at step {boundary} to policy 'tiny-mix' already (" in out, out
            assert "steps trained since): nothing done" in out, out
            assert f"trainer pid {resumed.pid} on {socket.gethostname()} holds the run" in out, out
            assert "is already in force" in out and "nothing to do" in out, out
            assert phases(run) == [(number, boundary)] and sorted(run.listdir("archive")) == archive
            assert run.read_bytes(POLICY_YAML) == policy and not run.exists(PIVOT_JSON)
            assert live_trainer(run).pid == resumed.pid  # never stopped, never a second one
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if (holder := live_trainer(run)) is not None:  # the resumed trainer (or, on the old code, a third)
            os.kill(holder.pid, signal.SIGTERM)
            wait_for(lambda: live_trainer(run) is None, 120, "the resumed trainer to stop")
