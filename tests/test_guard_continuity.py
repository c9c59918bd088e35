"""The divergence guard where runs diverge (issue 41), through real trainer processes on andrea-tiny:
a fork and a pivot that set the learning rate 300x are caught within a few steps (and the branch stops:
its divergence is its result), a pivot to other data fires nothing, oscillation and drift are caught,
a non-finite step under checkpoints every 10 with the default retention rolls back by its margin,
and checkpoints a fault left unwritten change what is retrained, never the remedy. The runs start
from copies of the session's trained reference (andrea-tiny to step 300, checkpoints 100, 200, 300:
tests/guard_parent.py)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from conftest import _env, andrea, start_trainer, wait_for
from guard_parent import guard_parent_fixture  # noqa: F401 (the guard_parent fixture)
from tiny import tiny_config

from andrea_core.config import GuardConfig
from andrea_core.run.guard_events import lr_changes, read_events
from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import GUARD_LOG, RunDir
from andrea_core.train.guard import EXIT_DIVERGED, Guard
from andrea_core.train.optim import lr_at


def train(run: Path, *args: str, check: bool = True, **extra: str):
    env = {**_env(), **extra}
    return andrea("train", "--run-dir", str(run), "--device", "cpu", *args, check=check, env=env)


@pytest.fixture
def parent(guard_parent, tmp_path) -> Path:
    shutil.copytree(guard_parent, tmp_path / "parent")
    return tmp_path / "parent"


def test_a_branch_forked_at_lr_300x_stops_at_its_divergence_naming_it(parent, tmp_path):
    """The issue's case 1 and 4: forked at 200 with train.lr=1.0 (333x), the branch used to train on
    with the guard blind (its detector empty), exit 0. Now its first steps are judged against the
    parent's and the branch stops within a few steps, exit 3, with one line saying where and under what."""
    andrea("fork", str(parent), "--step", "200", "--branch", "hot", "--set", "train.lr=1.0")
    branch = tmp_path / "parent-fork200-hot"
    proc = train(branch, "--max-steps", "260", check=False)
    assert proc.returncode == EXIT_DIVERGED, proc.stdout + proc.stderr
    (event,) = read_events(RunDir(str(branch)))
    assert (
        event.action == "stop"
        and event.rolled_back_to is None
        and 200 < event.spike_start <= event.step <= 206
    )
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"andrea: diverged at step {event.step} under train.lr=1.0 ({event.kind}: ")
    assert f"a branch of {parent} at step 200" in line and "train.guard.in_branch=remedy" in line
    assert read_history(RunDir(str(branch)))[-1].step < 210  # not trained on: nothing past the stop


def test_a_branch_under_in_branch_remedy_records_the_learning_rate_it_went_on_at(parent, tmp_path):
    """train.guard.in_branch remedy: the branch rolls back (never past its fork point) and guard.jsonl
    says from which step it trained at which factor of train.lr (lr_changes: what compare reports)."""
    andrea(
        "fork", str(parent), "--step", "200", "--branch", "fix",
        "--set", "train.lr=1.0", "--set", "train.guard.in_branch=remedy",
        "--set", "train.guard.max_rollbacks=8",
    )  # fmt: skip
    branch = tmp_path / "parent-fork200-fix"
    train(branch, "--max-steps", "230", check=False)
    events = read_events(RunDir(str(branch)))
    assert events and events[0].action == "rollback" and events[0].rolled_back_to == 200
    assert all(e.rolled_back_to is None or e.rolled_back_to >= 200 for e in events)
    changes = lr_changes(events)
    assert changes and changes[0][0] == 201 and changes[0][2] < 1
    history = {e.step: e for e in read_history(RunDir(str(branch)))}
    cfg = read_run(RunDir(str(branch))).config.train
    first, last, factor = changes[-1]
    assert last >= 230 and history[first].lr == lr_at(first, cfg) * factor  # trained at the scaled rate


def test_a_pivot_with_the_learning_rate_300x_is_caught_and_one_to_other_data_is_not(parent, tmp_path):
    """A pivot (new policy, same weights) to tiny-mix at 300: its new arms' losses move (prose is
    harder than code) and nothing fires in 100 steps; the same pivot training at 300x the learning rate
    (ANDREA_TEST_GUARD_LR_TIMES: a pivot cannot set it) is caught within a few steps of the boundary,
    judged against the closed phase."""
    other = tmp_path / "other"
    shutil.copytree(parent, other)
    for run in (parent, other):
        andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")
    train(other, "--max-steps", "400")
    assert not (other / GUARD_LOG).exists()
    assert len({e.arm for e in read_history(RunDir(str(other))) if e.step > 300}) == 3
    train(parent, "--max-steps", "330", check=False, ANDREA_TEST_GUARD_LR_TIMES="300@300")
    first = read_events(RunDir(str(parent)))[0]
    assert first.kind == "loss-spike" and 300 < first.spike_start <= first.step <= 306, first
    assert first.rolled_back_to == 300  # the phase's first checkpoint: never into the closed phase


@pytest.mark.parametrize("noise, within", [("oscillate@300", 60), ("drift@300:600", 400)])
def test_oscillation_and_drift_through_the_trainer(parent, noise, within):
    """Real steps on corrupted targets after 300 (ANDREA_TEST_GUARD_NOISE): on 2 of every 3 steps (the
    loss oscillates, never 3 loss spikes in a row), or a share of them rising over 600 steps (it drifts
    up, each step's loss within its spike threshold). The drift is the sustained-rise rule's alone; the
    oscillation is caught by it or, on this model, first by the gradient norm, which the corrupted
    steps drive up 3 steps in a row (measured: grad-norm-spike within a few steps of 300).
    The trainer is stopped (SIGTERM) once guard.jsonl holds its first event, which is all the test
    reads: the steps after it, to 300 + within + 40, trained nothing it asserts."""
    env = {**_env(), "ANDREA_TEST_GUARD_NOISE": noise}
    args = ("--run-dir", str(parent), "--device", "cpu", "--max-steps", str(300 + within + 40))
    proc = start_trainer(*args, env=env, log=parent.parent / "train.log")
    try:
        wait_for(lambda: (parent / GUARD_LOG).exists() or proc.poll() is not None, what="a guard event")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = read_events(RunDir(str(parent)))
    assert events, noise
    first = events[0]
    assert 300 < first.spike_start <= first.step <= 300 + within, first
    if noise.startswith("drift"):
        assert first.kind == "loss-rise" and first.value > first.threshold == pytest.approx(
            first.statistic + 1
        )
    else:
        assert first.kind in ("loss-rise", "grad-norm-spike"), first


def test_a_non_finite_step_under_tight_retention_rolls_back_by_its_margin(tmp_path):
    """The issue's case 3: checkpoints every 10, the default retention (newest 5), a NaN gradient at data
    position 85. Retention keeps every checkpoint that may still become the guard's rollback point (the
    69 steps before the newest; it used to keep the newest 5 and the one already that far back, none
    in a run this young), so the rollback goes 50 steps back, to 30, as had every checkpoint been kept:
    not to 40 (the oldest kept: a margin of 45) nor to the initial weights (today's case 3)."""
    cfg = tiny_config(tmp_path, train__checkpoint_every=10, train__max_steps=100, train__log_every=50)
    run = tmp_path / "run"
    proc = train(run, "--config", cfg, ANDREA_TEST_GUARD_NAN_AT="85")
    (event,) = read_events(RunDir(str(run)))
    assert (event.kind, event.step, event.rolled_back_to, event.remedy_from) == (
        "non-finite-grad-norm",
        85,
        30,
        35,
    )
    assert "back to step_000030.bin" in proc.stdout + proc.stderr


def _events(run: Path) -> list[tuple]:
    return [
        (
            e.number,
            e.action,
            e.step,
            e.spike_start,
            e.kind,
            e.remedy_from,
            e.skip,
            e.lr_scale,
            e.cooldown,
            e.level,
        )
        for e in read_events(RunDir(str(run)))
    ]


def test_checkpoints_a_fault_left_unwritten_change_what_is_retrained_never_the_remedy(tmp_path):
    """Issue 48 (the S3 soak, seed 11723): a full cache left the keep_every checkpoint 50 unwritten, and
    under the soak's retention (checkpoints every 5, the newest 3, every 50th) nothing else lived long
    enough to be 69 steps back: the divergence at 125 went back to 100 with its remedy after 100, where
    the run without the fault went back to 50 with its remedy after 75, and the two trained on other
    data from step 76. Here the same settings, one run straight to 130 with a NaN at 125, the other
    missing checkpoints 50 and 75 (each gone after the trainer passed it, as a failed write leaves it):
    the rollbacks' targets differ (75 against 70), the remedies do not (after 75, the same skip, rate
    and cooldown), and the two runs are the same, step for step and bit for bit."""
    cfg = tiny_config(
        tmp_path,
        train__checkpoint_every=5,
        train__log_every=50,
        retention__keep_last=3,
        retention__keep_every=50,
    )
    nan = {"ANDREA_TEST_GUARD_NAN_AT": "125"}
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    train(straight, "--config", cfg, "--max-steps", "130", **nan)
    train(faulted, "--config", cfg, "--max-steps", "52", **nan)
    (faulted / "step_000050.bin").unlink()
    train(faulted, "--max-steps", "77", **nan)
    (faulted / "step_000075.bin").unlink()
    train(faulted, "--max-steps", "130", **nan)
    events = {run.name: read_events(RunDir(str(run))) for run in (straight, faulted)}
    assert [e.rolled_back_to for e in events["straight"]] == [75]
    assert [e.rolled_back_to for e in events["faulted"]] == [70]
    assert _events(straight) == _events(faulted) and _events(straight)[0][5] == 75
    history = {
        run.name: [(e.step, e.loss, e.lr, e.arm, e.grad_norm) for e in read_history(RunDir(str(run)))]
        for run in (straight, faulted)
    }
    assert [h[0] for h in history["straight"]] == list(range(1, 131))
    assert history["straight"] == history["faulted"]
    assert (straight / "step_000130.bin").read_bytes() == (faulted / "step_000130.bin").read_bytes()


def test_restart_replays_what_came_before_its_floor(parent, tmp_path):
    """Guard.restart on real run directories: the detector holds the history before the start (a full
    window of the parent's steps in a branch), and the floor is the fork point (a rollback never goes
    past it; restart with floor 0 would send a branch back to the initial weights)."""
    andrea("fork", str(parent), "--step", "200", "--branch", "b")
    branch = RunDir(str(tmp_path / "parent-fork200-b"))
    g = Guard(branch, GuardConfig(), 256, log=lambda _: None, writes=False)
    g.restart(200, read_run(branch).lineage["parent_step"])
    assert g.floor == 200 and g.branch["parent_step"] == 200
    ((arm, series),) = g.detector.loss.items()
    assert list(series.values) == [e.loss for e in read_history(branch)][100:200]
    spikes = [g.detector.observe(201 + i, 7.0, None, arm) for i in range(3)]
    assert spikes[2] is not None and spikes[2].spike_start == 201
    # In the parent (no fork), floor 0: the initial weights are its own.
    g = Guard(RunDir(str(parent)), GuardConfig(), 256, log=lambda _: None, writes=False)
    g.restart(300, 0)
    assert g.floor == 0 and g.branch is None
