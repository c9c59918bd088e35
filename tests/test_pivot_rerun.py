"""A rerun of a pivot that completed finds it done, however far the new phase has trained since (the chaos
soak's fault 363, issue 48): one request, one phase folder."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from conftest import _env, andrea, last_logged_step, start_trainer, wait_for
from test_retention import fabricated_run

from andrea_core.data.policy import load_policy
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


def test_a_request_id_makes_a_rerun_exact_and_a_second_request_to_the_policy_in_force_a_new_phase(tmp_path):
    """With --request-id the phase folder a pivot closes records its request (phase.json): a rerun of it
    is done even after a later pivot to another policy (without one it would pivot back); another id is
    a new request, a new phase to the policy in force too (without one it is done already); an id of
    another policy's pivot, or a bad id, is refused before anything is touched; so is another id than
    the one of a pivot under way."""
    run = fabricated_run(str(tmp_path / "run"), [100, 200])

    def pivot(policy: str, request: str | None, check: bool = True):
        given = ["--request-id", request] if request is not None else []
        return andrea("pivot", run.url, "--policy", policy, "--no-restart", *given, check=check)

    def tree() -> dict[str, bytes]:
        root = Path(run.url)
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    tiny_mix, stdlib = (load_policy(name)[0].hash for name in ("tiny-mix", "stdlib-only"))
    pivot("tiny-mix", "r1")
    assert run.read_json("archive/phase_001_step_000200/phase.json")["request_id"] == "r1"
    assert run.read_json("archive/phase_001_step_000200/phase.json")["policy_hash"] == tiny_mix
    before = tree()
    assert "policy 'tiny-mix' is already in force" in pivot("tiny-mix", None).stdout  # no id: done
    again = pivot("tiny-mix", "r1").stdout
    assert "request 'r1' is done: the pivot to policy 'tiny-mix' at step 200 closed" in again, again
    assert tree() == before
    pivot("tiny-mix", "r2")  # a second request to the policy in force: a phase of its own
    assert phases(run) == [(1, 200), (2, 200)]
    assert run.read_json("archive/phase_002_step_000200/phase.json")["request_id"] == "r2"
    pivot("stdlib-only", "r3")
    assert run.read_json("archive/phase_003_step_000200/phase.json")["policy_hash"] == stdlib
    before = tree()
    assert "request 'r1' is done" in pivot("tiny-mix", "r1").stdout  # never a pivot back to tiny-mix
    wrong = pivot("stdlib-only", "r1", check=False)
    assert wrong.returncode == 2 and "request 'r1' was a pivot to the policy of hash" in wrong.stderr
    for bad in ("../x", "-x", "a" * 65, "a b"):
        refused = pivot("tiny-mix", bad, check=False)
        assert refused.returncode == 2 and "--request-id" in refused.stderr, refused.stderr
    assert tree() == before
    # A pivot under way finishes as the request it is: another id is refused, naming it.
    env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "archived"}
    argv = ["pivot", run.url, "--policy", "tiny-mix", "--no-restart"]
    assert andrea(*argv, "--request-id", "r4", check=False, env=env).returncode == -signal.SIGKILL
    other = pivot("tiny-mix", "r5", check=False)
    assert other.returncode == 2 and "the pivot under way is request 'r4', not 'r5'" in other.stderr
    pivot("tiny-mix", None)  # a rerun without the id finishes it
    assert run.read_json("archive/phase_004_step_000200/phase.json")["request_id"] == "r4"
    assert not run.exists(PIVOT_JSON) and "request 'r4' is done" in pivot("tiny-mix", "r4").stdout
