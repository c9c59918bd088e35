""".state.json keeps the bandit of exactly the checkpoints retention keeps (issue 15.7): a fork or a resume
at any kept checkpoint restores that checkpoint's bandit instead of starting a fresh one."""

from __future__ import annotations

import numpy as np

from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import load_run_config
from andrea_core.data.pipeline import make_mixer
from andrea_core.data.policy import load_policy
from andrea_core.data.state import BanditStore
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.run.record import read_run, run_n_params
from andrea_core.run.retention import apply_retention
from andrea_core.run.rundir import STATE, RunDir
from andrea_core.train.setup import create_run
from tests.conftest import REPO
from tests.test_data_state import train

MIX = str(REPO / "configs" / "andrea-tiny-mix.yaml")


def trained_with_retention(path, stops: list[int], **overrides) -> tuple[RunDir, dict[int, dict]]:
    """A run of andrea-tiny-mix's config (checkpoint_every 50, keep_last 5; `overrides` set) whose bandit
    trains to each step of `stops` in turn, writing the state, a checkpoint and running retention as the
    trainer does. Returns the run and the mixer state of every checkpoint written."""
    run = RunDir(str(path))
    record = create_run(run, load_run_config(MIX).with_overrides(overrides))
    policy, _ = load_policy(record.config.data.policy)
    arms = [a.name for a in policy.arms]
    store = BanditStore(run, policy, record.config.train.checkpoint_every, warn=print)
    mixer = make_mixer(policy, arms)
    store.restore(mixer, 0)
    zeros = np.zeros(3 * run_n_params(record), dtype=np.float32)
    states, last = {}, 0
    for step in stops:
        train(mixer, last + 1, step)
        last = step
        store.save(mixer, step)
        states[step] = mixer.state_dict()
        run.write_atomic(checkpoint_name(step), encode(step, zeros))
        apply_retention(run, record.config.retention, None, newest=step)
    return run, states


def restored(run: RunDir, step: int, log: list[str]):
    policy, _ = load_policy(read_run(run).config.data.policy)
    mixer = make_mixer(policy, [a.name for a in policy.arms])
    store = BanditStore(run, policy, 50, warn=log.append)
    store.restore(mixer, step)
    return store, mixer


def test_every_kept_checkpoint_has_its_bandit(tmp_path):
    # Grid checkpoints to 300, with an off-grid SIGUSR1 checkpoint at 237 on the way.
    run, states = trained_with_retention(tmp_path / "run", [50, 100, 150, 200, 237, 250, 300])
    kept = run.checkpoint_steps()
    assert kept == [150, 200, 237, 250, 300]  # retention: keep_last 5
    doc = run.read_json(STATE)
    assert sorted([doc["step"], *(e["step"] for e in doc["previous"])]) == kept
    for step in kept:
        log: list[str] = []
        store, mixer = restored(run, step, log)
        assert store.restored and log == [], f"step {step}: {log}"
        assert mixer.state_dict() == states[step]


def test_the_checkpoints_that_may_become_the_guards_rollback_point_keep_their_bandit(tmp_path):
    """Checkpoints every 10, the newest 2: retention keeps the guard's rollback point (69 steps back)
    and every newer checkpoint, each of which a rollback may restore; their bandits stay in the file,
    written by the save itself (not only put back after retention, a write later)."""
    stops = list(range(10, 210, 10))
    run, states = trained_with_retention(
        tmp_path / "run",
        stops,
        **{"train.checkpoint_every": 10, "retention.keep_last": 2, "retention.keep_every": None},
    )
    kept = run.checkpoint_steps()
    assert kept == [130, 140, 150, 160, 170, 180, 190, 200]  # 130: 71 steps before 201
    doc = run.read_json(STATE)
    assert sorted([doc["step"], *(e["step"] for e in doc["previous"])]) == kept
    for step in (130, 170):
        log: list[str] = []
        store, mixer = restored(run, step, log)
        assert store.restored and log == [] and mixer.state_dict() == states[step], step


def test_a_fork_point_keeps_its_bandit_as_long_as_its_checkpoint(tmp_path):
    """The issue's case: a fork at 100 of a run then trained on to 300 (keep_last 5 deletes 100's
    neighbours, never 100: a fork point). The state of 100 stays with it."""
    run, states = trained_with_retention(tmp_path / "run", [50, 100])
    (branch,) = fork(run.url, [BranchSpec("b")], step=100)
    policy, _ = load_policy(read_run(run).config.data.policy)
    store = BanditStore(run, policy, 50, warn=print)
    mixer = make_mixer(policy, [a.name for a in policy.arms])
    store.restore(mixer, 100)
    record = read_run(run)
    zeros = np.zeros(3 * run_n_params(record), dtype=np.float32)
    for step in (150, 200, 250, 300, 350, 400):
        train(mixer, step - 49, step)
        store.save(mixer, step)
        run.write_atomic(checkpoint_name(step), encode(step, zeros))
        apply_retention(run, record.config.retention, None, newest=step)
    assert 100 in run.checkpoint_steps() and 50 not in run.checkpoint_steps()
    log: list[str] = []
    store, mixer = restored(run, 100, log)
    assert store.restored and log == [] and mixer.state_dict() == states[100]
