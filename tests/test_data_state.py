""".state.json on a real run directory: write order, kept states, policy hashes, zombies, bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import ConfigError, RetentionConfig
from andrea_core.data.mixer import Exp3Mixer
from andrea_core.data.pipeline import make_mixer, step_rng
from andrea_core.data.policy import parse_policy
from andrea_core.data.state import BanditStore
from andrea_core.ops.pivot import archive_phase
from andrea_core.run.rundir import ARCHIVE, STATE, RunDir

ARMS = ["stdlib-code", "repo-docstrings", "docs-prose"]


def make_policy(cap: float = 0.6):
    return parse_policy(
        {
            "name": "three",
            "mixer": "exp3",
            "arms": [
                {"name": "stdlib-code", "kind": "python-stdlib", "floor": 0.15, "cap": cap},
                {"name": "repo-docstrings", "kind": "docstrings", "floor": 0.2, "cap": 0.6},
                {"name": "docs-prose", "kind": "prose", "floor": 0.15, "cap": 0.6},
            ],
        },
        "three.yaml",
    )


def train(mixer, first: int, last: int) -> None:
    """Steps first..last as the pipeline runs them, with losses that differ by arm and fall."""
    for step in range(first, last + 1):
        arm = mixer.choose(step, step_rng(1337, step))
        mixer.observe(step, arm, (2.0 + mixer.arms.index(arm)) * (1 + 2 / step))


def store(run, policy, unavailable=None, log=None):
    return BanditStore(run, policy, 50, unavailable, warn=(log.append if log is not None else print))


def trained_run(path, policy, arms=ARMS, steps: int = 100):
    """A run directory whose bandit trained `steps` steps and saved its state at the last one."""
    run = RunDir(str(path))
    s, mixer = store(run, policy), make_mixer(policy, arms)
    s.restore(mixer, 0)
    train(mixer, 1, steps)
    s.save(mixer, steps)
    return run, s, mixer


def test_a_crash_between_state_and_checkpoint_resumes_the_previous_checkpoints_bandit(tmp_path):
    policy = make_policy()
    run, s, mixer = trained_run(tmp_path, policy, steps=50)
    at_50 = mixer.state_dict()
    train(mixer, 51, 100)
    s.save(mixer, 100)  # ...and the process dies before step_000100.bin is published

    resumed, log = make_mixer(policy, ARMS), []
    s2 = store(run, policy, log=log)
    s2.restore(resumed, 50)  # the newest checkpoint on disk
    assert resumed.state_dict() == at_50 and log == []
    assert [e["step"] for e in s2.history] == [50], "the dead timeline's state for 100 must be dropped"
    train(resumed, 51, 80)
    s2.save(resumed, 80)
    doc = run.read_json(STATE)
    assert doc["step"] == 80 and [e["step"] for e in doc["previous"]] == [50]


def test_kept_states_are_those_of_the_checkpoints_retention_keeps(tmp_path):
    """An interrupted run keeps its off-grid checkpoints (57, 104) as retention does, and their states
    with them; a state whose checkpoint retention deleted (50, once five newer exist) goes too. The
    bandit trains between saves, so the kept states differ in content, not only in step, and the states
    of the steps both runs share are the same bandit."""
    policy = make_policy()
    docs = []
    for name, steps in (("straight", [50, 100, 150, 200]), ("interrupted", [50, 57, 100, 104, 150, 200])):
        run = RunDir(str(tmp_path / name))
        mixer = make_mixer(policy, ARMS)
        s = store(run, policy)
        s.restore(mixer, 0)
        done = 0
        for step in steps:
            train(mixer, done + 1, step)
            done = step
            s.save(mixer, step)
            run.write_atomic(checkpoint_name(step), encode(step, np.zeros(3, dtype=np.float32)))
            if step == 104:  # a SIGTERM checkpoint, then a new trainer (a new bandit) resumes from it
                mixer = make_mixer(policy, ARMS)
                s = store(run, policy)
                s.restore(mixer, 104)
        docs.append(run.read_json(STATE))
    straight, interrupted = docs
    assert [straight["step"], *(e["step"] for e in straight["previous"])] == [200, 150, 100, 50]
    assert [interrupted["step"], *(e["step"] for e in interrupted["previous"])] == [200, 150, 104, 100, 57]
    by_step = {e["step"]: e for e in straight["previous"]}
    shared = [e for e in interrupted["previous"] if e["step"] in by_step]
    assert [e["step"] for e in shared] == [150, 100]
    assert all(e == by_step[e["step"]] for e in shared)
    assert {k: v for k, v in straight.items() if k != "previous"} == {
        k: v for k, v in interrupted.items() if k != "previous"
    }
    kept = [
        json.dumps({k: v for k, v in e.items() if k != "step"}, sort_keys=True) for e in straight["previous"]
    ]
    assert len(set(kept)) == 3, "each kept state is the bandit of its own step"


def test_a_state_of_another_policy_is_not_loaded_and_is_kept_aside(tmp_path):
    old = make_policy(cap=0.6)
    run, _, _ = trained_run(tmp_path, old)
    before = run.read_bytes(STATE)

    new, log = make_policy(cap=0.5), []
    fresh = make_mixer(new, ARMS)
    s2 = store(run, new, log=log)
    s2.restore(fresh, 100)
    assert fresh.state_dict() == make_mixer(new, ARMS).state_dict(), "the bandit must start fresh"
    assert len(log) == 1 and f"hash {old.hash}" in log[0] and f"hash {new.hash}" in log[0]
    (aside,) = run.listdir(ARCHIVE)
    assert run.read_bytes(f"{ARCHIVE}/{aside}") == before and not run.exists(STATE)
    s2.save(fresh, 150)
    doc = run.read_json(STATE)
    assert doc["policy_hash"] == new.hash and doc["phase"] == {"number": 1, "start_step": 100, "steps": 50}


def test_after_a_pivot_the_bandit_is_fresh_and_counts_the_new_phase(tmp_path):
    policy = make_policy()
    run, _, _ = trained_run(tmp_path, policy)
    run.write_atomic(checkpoint_name(100), encode(100, np.zeros(30, dtype=np.float32)))
    archive_phase(run, 100)  # moves .state.json into archive/phase_001_step_000100/

    log, fresh = [], make_mixer(policy, ARMS)
    s2 = store(run, policy, log=log)
    s2.restore(fresh, 100)
    assert s2.phase.number == 2 and s2.phase.start_step == 100
    assert log == ["bandit: no .state.json: a fresh bandit from step 100 (phase 2)"]
    assert int(fresh.pulls.sum()) == 0


def test_back_to_the_step_a_phase_began_the_bandit_is_fresh_in_that_phase_and_nothing_is_set_aside(tmp_path):
    """A rollback (or a fallback) to a pivot's checkpoint: the phase's .state.json has states only past
    its start, and a fresh bandit is that phase's state at its start: phase number and start kept, no
    'has no state' warning, nothing moved to archive/, the dead timeline's states dropped at the next
    save. A step inside a phase without a state is still set aside with its warning."""
    policy = make_policy()
    run, _, _ = trained_run(tmp_path, policy)
    run.write_atomic(checkpoint_name(100), encode(100, np.zeros(30, dtype=np.float32)))
    archive_phase(run, 100)
    phase2 = store(run, policy, log=[])
    mixer = make_mixer(policy, ARMS)
    phase2.restore(mixer, 100)
    train(mixer, 101, 150)
    phase2.save(mixer, 150)
    archived = sorted(p.name for p in (tmp_path / ARCHIVE).iterdir())

    log, fresh = [], make_mixer(policy, ARMS)
    back = store(run, policy, log=log)
    back.restore(fresh, 100)
    assert (back.phase.number, back.phase.start_step, back.restored) == (2, 100, False)
    assert log == ["bandit: back to step 100, where phase 2 began: a fresh bandit"]
    assert int(fresh.pulls.sum()) == 0
    assert sorted(p.name for p in (tmp_path / ARCHIVE).iterdir()) == archived
    train(fresh, 101, 150)
    back.save(fresh, 150)
    doc = json.loads((tmp_path / STATE).read_text())
    assert (doc["step"], doc["previous"], doc["phase"]) == (
        150,
        [],
        {"number": 2, "start_step": 100, "steps": 50},
    )

    log = []
    store(run, policy, log=log).restore(make_mixer(policy, ARMS), 120)
    assert len(log) == 1 and "has no state for step 120 (it has [150])" in log[0], log


def test_zombie_arm_is_dropped_with_a_warning_and_the_other_arms_are_kept(tmp_path):
    policy = make_policy()
    run, _, _ = trained_run(tmp_path, policy)
    doc = run.read_json(STATE)
    doc["arms"]["repo-docstrings"]["weight"] = 1.546  # the design's case
    doc["arms"]["old-arm"] = {"pulls": 7, "reward": 0.3, "loss_baseline": 2.0, "weight": 0.8, "p": 0.1}
    run.write_json(STATE, doc)

    live = ["stdlib-code", "docs-prose"]
    resumed, log = make_mixer(policy, live), []
    store(run, policy, {"repo-docstrings": "no source files found"}, log).restore(resumed, 100)
    assert len(log) == 2
    (zombie,) = [line for line in log if "'repo-docstrings'" in line]
    (gone,) = [line for line in log if "'old-arm'" in line]
    assert zombie.startswith(
        "warning: zombie arm 'repo-docstrings' dropped: its source is unavailable (no source"
    )
    assert "weight 1.546" in zombie and f"{doc['arms']['repo-docstrings']['pulls']} pulls" in zombie
    assert "its floor 0.2 is released" in zombie and "re-projected over stdlib-code, docs-prose" in zombie
    assert gone.startswith("warning: zombie arm 'old-arm' dropped: the policy 'three' no longer lists it")
    state = resumed.state_dict()
    assert list(state["arms"]) == live
    for arm in live:
        for key in ("pulls", "reward", "loss_baseline"):
            assert state["arms"][arm][key] == doc["arms"][arm][key]
    p = resumed.probabilities()
    assert abs(p.sum() - 1) < 1e-12 and np.all(p >= 0.15 - 1e-12) and np.all(p <= 0.6 + 1e-12)
    # The exploration accounting counts live pulls only: no phantom pulls of the zombie.
    assert int(resumed.pulls.sum()) == sum(doc["arms"][a]["pulls"] for a in live)
    draws = {resumed.choose(step, step_rng(1337, step)) for step in range(101, 1101)}
    assert draws == set(live)


def test_an_arm_new_to_the_state_starts_at_the_prior(tmp_path):
    policy = make_policy()
    two = ["stdlib-code", "docs-prose"]  # repo-docstrings had no source when the state was written
    run, _, mixer = trained_run(tmp_path, policy, two)
    resumed, log = make_mixer(policy, ARMS), []
    store(run, policy, log=log).restore(resumed, 100)
    assert log == ["bandit: arm 'repo-docstrings' is new to the bandit and starts at the prior"]
    arms = resumed.state_dict()["arms"]
    assert arms["repo-docstrings"]["pulls"] == 0 and arms["repo-docstrings"]["reward"] == 0.0
    assert arms["stdlib-code"]["pulls"] == mixer.state_dict()["arms"]["stdlib-code"]["pulls"]


def test_an_unreadable_state_is_refused_naming_the_file(tmp_path):
    run, policy = RunDir(str(tmp_path)), make_policy()
    run.write_text(STATE, '{"format": 1, "step": "x"')
    with pytest.raises(ConfigError, match=rf"{tmp_path}/{STATE}: not a bandit state .*move it aside"):
        store(run, policy).restore(Exp3Mixer(ARMS, [0.0] * 3, [1.0] * 3), 100)


def test_a_checkpoint_a_pivot_protects_after_the_save_that_dropped_its_state_gets_it_back(tmp_path):
    """The chaos soak's finding (seed 1, pivots 812 and four more): keep_last 5 at checkpoints 10..60
    every 10; the save of 60 drops 10's state (10 falls out of the newest five), then a pivot's intent
    protects 10, then checkpoint 60 is written and retention keeps 10 for the pivot. Its state must be in
    the file again once retention has run (keep_states), as the state of every kept checkpoint is."""
    from andrea_core.data.policy import load_policy
    from andrea_core.ops.pivot import parse_policy_text
    from andrea_core.run.pivot_journal import record_pivot
    from andrea_core.run.retention import apply_retention

    policy = make_policy()
    run = RunDir(str(tmp_path / "run"))
    mixer, s, states = make_mixer(policy, ARMS), store(run, policy), {}
    s.restore(mixer, 0)
    zeros = np.zeros(3, dtype=np.float32)
    cfg = RetentionConfig(keep_last=5, keep_every=None)
    for step in range(10, 70, 10):
        train(mixer, step - 9, step)
        s.save(mixer, step)
        states[step] = json.loads(json.dumps(s.history[0]))
        if step == 60:  # the pivot's intent lands between the state's save and the checkpoint
            record_pivot(run, parse_policy_text(load_policy("tiny-mix")[1], "tiny-mix"), "intent", 10)
        run.write_atomic(checkpoint_name(step), encode(step, zeros))
        plan = apply_retention(run, cfg, None, newest=step)
        s.keep_states(set(plan.keep))
    assert run.checkpoint_steps() == [10, 20, 30, 40, 50, 60]  # 10 kept for the pivot, the newest five
    doc = run.read_json(STATE)
    kept = {doc["step"]: doc, **{e["step"]: e for e in doc["previous"]}}
    assert sorted(kept) == [10, 20, 30, 40, 50, 60]
    assert {k: v for k, v in kept[10].items() if k != "previous"} == states[10]
