"""The run's target is part of the run (issue 26.1): --max-steps is recorded in target.jsonl, a resume
without it trains on to it, a pivot keeps it (or records a new one), and `andrea status` says STOPPED,
COMPLETED, PIVOTING or CREATING with the percentage of that target. Real trainer processes."""

from __future__ import annotations

import json
import signal

import pytest
from conftest import _env, andrea, last_logged_step, start_trainer, wait_for
from tiny import tiny_config

from andrea_core.config import ConfigError
from andrea_core.ops.status import run_status
from andrea_core.run import lock
from andrea_core.run.rundir import RUN_YAML, TARGET, RunDir
from andrea_core.run.target import read_target

EVERY = 20
FROZEN = 40  # run.yaml's max_steps: the number every resume used to fall back to


def status(run) -> dict:
    return json.loads(andrea("status", str(run), "--json").stdout)[0]


def targets(run) -> list[tuple[int, int, str]]:
    lines = (run / TARGET).read_text().splitlines()
    return [(d["max_steps"], d["step"], d["by"]) for d in map(json.loads, lines)]


@pytest.mark.slow
def test_the_target_survives_sigterm_resume_and_a_new_target(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__max_steps=FROZEN)
    trainer = start_trainer("--config", cfg, "--run-dir", str(run), "--max-steps", "120", "--pace", "0.05")
    try:
        wait_for(lambda: last_logged_step(run) >= 50, timeout=300, what="step 50")
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=300) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert targets(run) == [(120, 0, "andrea train --max-steps")]

    st = status(run)
    stopped = st["step"]
    assert 50 <= stopped < 120 and st["state"] == "stopped", st
    assert (st["max_steps"], st["max_steps_from"]) == (120, f"{TARGET} (andrea train --max-steps, at step 0)")
    text = andrea("status", str(run)).stdout
    assert "STOPPED: no trainer running, before its target (step 120);" in text
    assert f"{stopped} of 120 ({100 * stopped / 120:.0f}%)  (target from {TARGET}" in text

    # A plain resume trains on to the run's target, not to run.yaml's 40.
    out = andrea("train", "--run-dir", str(run)).stdout
    assert f"training steps {stopped + 1}..120" in out
    assert last_logged_step(run) == 120
    st = status(run)
    assert (st["state"], st["step"], st["max_steps"]) == ("completed", 120, 120)
    assert "120 of 120 (100%)" in andrea("status", str(run)).stdout
    assert targets(run) == [(120, 0, "andrea train --max-steps")]  # the same target: no second line

    # A new target is one more line; the next plain start has nothing to do.
    andrea("train", "--run-dir", str(run), "--max-steps", "140")
    assert targets(run) == [(120, 0, "andrea train --max-steps"), (140, 120, "andrea train --max-steps")]
    again = andrea("train", "--run-dir", str(run))
    assert "already at step 140 >= max_steps 140; nothing to do" in again.stdout
    assert status(run)["state"] == "completed"


@pytest.mark.slow
def test_a_pivot_keeps_the_target_or_records_its_own_and_status_says_pivoting(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__max_steps=FROZEN)
    andrea("train", "--config", cfg, "--run-dir", str(run), "--max-steps", "100")
    andrea("train", "--run-dir", str(run), "--max-steps", "200")
    # A pivot without --max-steps: the resumed phase trains to the run's target (200), not to 40.
    andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")
    assert read_target(RunDir(str(run)), FROZEN).max_steps == 200
    st = status(run)
    assert (st["state"], st["step"], st["max_steps"]) == (
        "completed",
        200,
        200,
    )  # a new phase, the same target
    # A pivot with --max-steps makes it the target (one line, by the pivot).
    andrea("pivot", str(run), "--policy", "stdlib-only", "--no-restart", "--max-steps", "220")
    assert targets(run)[-1] == (220, 200, "andrea pivot")
    out = andrea("train", "--run-dir", str(run)).stdout
    assert "training steps 201..220" in out and last_logged_step(run) == 220

    # A pivot killed half way: PIVOTING, naming both ways out.
    env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "archive-move-1"}
    killed = andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart", env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    st = status(run)
    assert st["state"] == "pivoting" and st["pivot"]["policy"] == "tiny-mix", st
    text = andrea("status", str(run)).stdout
    assert "PIVOTING: a pivot to policy 'tiny-mix' is half done (no trainer running)" in text
    assert f"andrea pivot {run} --abandon" in text and "220 of 220 (100%)" in text


def test_creating_a_live_trainer_before_run_yaml(tmp_path):
    run = RunDir(str(tmp_path / "new"))
    me = lock.acquire(run, log=lambda msg: None)  # this process stands in for a trainer creating the run
    try:
        st = run_status(run.url)
        assert st.state == "creating" and st.trainer["pid"] == me.pid, st
        assert f"trainer pid {me.pid} on {me.host} is creating the run (no {RUN_YAML} yet" in st.summary
    finally:
        lock.release(run, me)
    # Neither a run nor a live trainer: not a run directory, as before.
    proc = andrea("status", run.url, check=False)
    assert proc.returncode == 2 and "not a run directory (no run.yaml)" in proc.stderr


def test_our_own_trainer_is_seen_creating_its_run_never_as_no_run(tmp_path):
    """`andrea train --config` takes the lease before it creates the run (its data checked, run.yaml
    written): polled as fast as status can read, the directory goes from no run at all to CREATING, with
    our trainer's pid, to TRAINING, and is never "not a run directory" once the trainer holds it."""
    run = tmp_path / "new"
    env = _env() | {"ANDREA_CACHE_DIR": str(tmp_path / "cold-cache")}  # the arms tokenized while creating
    proc = start_trainer(
        "--config", tiny_config(tmp_path), "--run-dir", str(run), "--max-steps", "2", env=env
    )
    seen: list[str] = []  # each state once, in the order first seen
    try:
        while proc.poll() is None:
            try:
                st = run_status(str(run))
                state, pid = st.state, (st.trainer or {}).get("pid")
            except ConfigError as e:
                state, pid = ("no run" if "not a run directory" in str(e) else str(e)), None
            assert state != "creating" or pid == proc.pid, (state, pid)
            if not seen or seen[-1] != state:
                seen.append(state)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.wait() == 0
    assert seen[seen.index("creating") :] == ["creating", "training", "completed"], seen
    assert set(seen[: seen.index("creating")]) <= {"no run"}, seen


def test_a_torn_or_forged_target_line_is_skipped(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    good = {"max_steps": 500, "step": 100, "by": "andrea train --max-steps", "time": 1.0}
    lines = [
        json.dumps(good),
        '{"max_steps": true, "step": 0, "by": "x"}',
        '{"max_steps": -3, "step": 0, "by": "x"}',
    ]
    lines += [json.dumps({**good, "max_steps": 2**40}), '{"max_steps": 700, "st']  # huge, torn
    run.write_text(TARGET, "\n".join(lines))
    warned: list[str] = []
    target = read_target(run, 40, warn=warned.append)
    assert (target.max_steps, target.source) == (500, f"{TARGET} (andrea train --max-steps, at step 100)")
    assert warned == [f"{run.path(TARGET)}: skipped 4 malformed line(s): lines 2, 3, 4, 5"]
    proc = andrea("train", "--run-dir", run.url, "--max-steps", "0", check=False)
    assert proc.returncode == 2 and "--max-steps 0: expected a whole number of steps" in proc.stderr
