"""Real trainer processes with the bandit on: bit-exact resume, a zombie arm, no arm at all."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import fsspec
import pytest
from conftest import REPO, andrea
from data_runs import EVERY, STEPS, mix_runs

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.loss_log import parse_lines, read_history
from andrea_core.run.rundir import LOSS_LOG, STATE, RunDir

TINY_MIX = (REPO / "configs" / "andrea-tiny-mix.yaml").read_text()


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return mix_runs(tmp_path_factory)


@pytest.mark.slow
def test_sigterm_then_resume_is_bit_exact_with_the_bandit_on(mix):
    a, b = mix.uninterrupted, mix.interrupted
    assert EVERY < mix.usr1_step < 2 * EVERY < mix.stop_step < STEPS, (mix.usr1_step, mix.stop_step)
    assert f"resuming {b.url} from {checkpoint_name(mix.stop_step)}" in mix.resume_log
    assert "fresh bandit" not in mix.resume_log
    for step in (3 * EVERY, STEPS):
        assert a.read_bytes(checkpoint_name(step)) == b.read_bytes(checkpoint_name(step)), step
    sa, sb = a.read_json(STATE), b.read_json(STATE)
    assert sa.pop("previous") != sb.pop("previous") and sa == sb  # the newest state: the same bandit
    # Each run keeps the states of the checkpoints it keeps (the interrupted one's off-grid SIGUSR1 and
    # SIGTERM checkpoints too): the states of the checkpoints both have are the same bandit.
    previous_a, previous_b = a.read_json(STATE)["previous"], b.read_json(STATE)["previous"]
    assert [e["step"] for e in previous_b] == sorted(set(b.checkpoint_steps()) - {STEPS}, reverse=True)
    shared = {e["step"]: e for e in previous_a}
    assert all(e == shared[e["step"]] for e in previous_b if e["step"] in shared)

    # The same batches, arm for arm, and the bandit really mixed: every arm drawn, and the state's
    # pulls are exactly the draws the loss log records. The state of checkpoint S is the bandit that
    # draws batch S+1: the trainer reads each loss one step late, so it has heard steps 1..S-1.
    ha, hb = read_history(a), read_history(b)
    assert [(e.step, e.loss, e.arm) for e in ha] == [(e.step, e.loss, e.arm) for e in hb]
    assert {e.segment for e in hb} == {1, 2}
    drawn = Counter(e.arm for e in ha if e.step < STEPS)
    state = a.read_json(STATE)
    assert state["step"] == STEPS and state["mixer"] == "exp3"
    assert {arm: s["pulls"] for arm, s in state["arms"].items()} == dict(drawn)
    assert set(drawn) == {"stdlib-code", "repo-docstrings", "docs-prose"}
    assert [e["step"] for e in state["previous"]] == [150, 100, 50]


def zombie_policy(packages: str) -> str:
    return (
        "name: zombie-test\nmixer: exp3\narms:\n"
        "  - {name: stdlib-code, kind: python-stdlib, floor: 0.15, cap: 0.6}\n"
        f"  - {{name: repo-docstrings, kind: docstrings, packages: [{packages}], floor: 0.2, cap: 0.6}}\n"
        "  - {name: docs-prose, kind: prose, floor: 0.15, cap: 0.6}\n"
    )


@pytest.mark.slow
def test_zombie_repo_docstrings_arm_is_dropped_never_pulled_and_the_rest_is_kept(tmp_path, monkeypatch):
    # An installed package whose docstrings feed repo-docstrings, and that will be uninstalled.
    site = tmp_path / "site"
    fsspec_dir = Path(fsspec.__file__).parent
    shutil.copytree(fsspec_dir, site / "zombiedocs", ignore=shutil.ignore_patterns("__pycache__", "tests"))
    monkeypatch.setenv("PYTHONPATH", str(site))
    (tmp_path / "policy.yaml").write_text(zombie_policy("zombiedocs"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY_MIX.replace("policy: tiny-mix", f"policy: {tmp_path / 'policy.yaml'}"))
    run = RunDir(str(tmp_path / "run"))
    andrea("train", "--config", str(cfg), "--run-dir", run.url, "--max-steps", "50")
    before = run.read_json(STATE)
    assert before["step"] == 50 and before["arms"]["repo-docstrings"]["pulls"] > 0
    before["arms"]["repo-docstrings"]["weight"] = 1.546  # the state the design's operator found
    run.write_text(STATE, json.dumps(before))

    shutil.rmtree(site / "zombiedocs")  # the source is gone
    out = andrea("train", "--run-dir", run.url, "--max-steps", "80").stdout
    pulls = before["arms"]["repo-docstrings"]["pulls"]
    assert (
        "warning: zombie arm 'repo-docstrings' dropped: its source is unavailable (arm 'repo-docstrings' "
        f"(docstrings): no source files found on this machine); its state (weight 1.546, {pulls} pulls) "
        "is not loaded and it will never be pulled, its floor 0.2 is released; the distribution is "
        "re-projected over stdlib-code, docs-prose"
    ) in out

    entries, _ = parse_lines(run.read_bytes(LOSS_LOG))
    resumed = [e for e in entries if e["segment"] == 2]
    assert [e["step"] for e in resumed] == list(range(51, 81))
    assert "repo-docstrings" not in {e["arm"] for e in resumed}, "the zombie was pulled"
    after = run.read_json(STATE)
    assert sorted(after["arms"]) == ["docs-prose", "stdlib-code"]
    # The state of checkpoint S has heard the losses of steps up to S-1 (the trainer reads each loss
    # one step late): from 50 to 80 the bandit heard steps 50..79, step 50's loss read from .loss.json.
    drawn = Counter(e.arm for e in read_history(run) if 50 <= e.step < 80)
    for arm in ("stdlib-code", "docs-prose"):
        assert after["arms"][arm]["pulls"] == before["arms"][arm]["pulls"] + drawn[arm]
        assert 0.15 <= after["arms"][arm]["p"] <= 0.6 + 1e-12
    assert abs(sum(s["p"] for s in after["arms"].values()) - 1.0) < 1e-12
    assert after["step"] == 80 and after["phase"] == {"number": 1, "start_step": 0, "steps": 80}


def test_no_available_arm_is_a_clear_error_before_training(tmp_path):
    missing = tmp_path / "no-such-docs"
    (tmp_path / "policy.yaml").write_text(
        f"name: nothing-here\nmixer: exp3\narms:\n  - {{name: docs, kind: prose, paths: [{missing}]}}\n"
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY_MIX.replace("policy: tiny-mix", f"policy: {tmp_path / 'policy.yaml'}"))
    run = RunDir(str(tmp_path / "run"))
    proc = andrea("train", "--config", str(cfg), "--run-dir", run.url, check=False)
    assert proc.returncode == 2
    assert (
        "andrea: error: policy 'nothing-here': none of its arms has data on this machine, nothing to "
        "train on (docs: arm 'docs' (prose): no source files found on this machine)"
    ) in proc.stderr
    assert run.checkpoint_steps() == [] and not run.exists(LOSS_LOG) and not run.exists(STATE)


@pytest.mark.slow
def test_a_missing_arm_whose_absence_leaves_caps_below_1_trains_on_scaled_then_gets_its_caps_back(tmp_path):
    """Issue 43.8: the arm left (cap 0.6) could not take all the mass: exit 2 'caps sum to 0.6 < 1', no
    data.jsonl line, and systemd does not restart on 2. Now its cap is scaled to 1 (policy.live_caps),
    recorded in data.jsonl and shown by status, and the policy's caps come back with the arm."""
    from corpus_files import write_text_folder

    from andrea_core.data.changes import read_data_log
    from andrea_core.ops.status import run_status

    root = tmp_path / "corpus"
    write_text_folder(str(root), n=40)
    (tmp_path / "policy.yaml").write_text(
        "name: half-caps\nmixer: exp3\narms:\n"
        "  - {name: stdlib-code, kind: python-stdlib, cap: 0.6}\n"
        f"  - {{name: notes, kind: text, paths: [{root / 'text'}], cap: 0.6}}\n"
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY_MIX.replace("policy: tiny-mix", f"policy: {tmp_path / 'policy.yaml'}"))
    run = RunDir(str(tmp_path / "run"))
    andrea("train", "--config", str(cfg), "--run-dir", run.url, "--max-steps", "20")

    (root / "text").rename(root / "away")  # the mount went away
    proc = andrea("train", "--run-dir", run.url, "--max-steps", "40", check=False)
    assert proc.returncode == 0, proc.stderr
    assert (
        "warning: without the unavailable arm(s) notes, the caps of stdlib-code 0.6 sum to 0.6 < 1: each is "
        "scaled x1.667 to sum to 1 (stdlib-code 1) and training goes on; the policy's caps hold again once "
        "the arm(s) return (data.jsonl)"
    ) in proc.stdout
    log = read_data_log(run)
    assert [(e["step"], e["arm"], e["event"]) for e in log] == [
        (0, "stdlib-code", "loaded"), (0, "notes", "loaded"),
        (20, "notes", "unavailable"), (20, "notes", "caps_scaled"),
    ]  # fmt: skip
    assert log[-1]["caps"] == {"stdlib-code": 1.0} and log[-1]["scale"] == pytest.approx(1 / 0.6)
    assert log[-1]["why"].startswith("notes: arm 'notes' (text): "), log[-1]["why"]
    history = read_history(run)
    assert [e.step for e in history] == list(range(1, 41))
    assert {e.arm for e in history if e.step > 20} == {"stdlib-code"}
    assert {e.arm for e in history if e.step <= 20} == {"stdlib-code", "notes"}
    problems = run_status(run.url).problems
    assert any(p.startswith("arm 'notes' unavailable since step 20 (") for p in problems), problems
    assert (
        "caps scaled x1.667 since step 20 to sum to 1 without arm(s) notes: stdlib-code 1; the policy's "
        "caps hold again when they return (data.jsonl)"
    ) in problems

    (root / "away").rename(root / "text")  # back
    out = andrea("train", "--run-dir", run.url, "--max-steps", "60").stdout
    assert "the caps of policy 'half-caps' hold again: arm(s) notes returned (data.jsonl)" in out
    log = read_data_log(run)
    assert [(e["step"], e["arm"], e["event"]) for e in log[4:]] == [
        (40, "notes", "returned"), (40, "notes", "caps_restored"),
    ]  # fmt: skip
    assert log[-1]["caps"] == {"stdlib-code": 0.6, "notes": 0.6} and log[-1]["scale"] == 1.0
    assert {e.arm for e in read_history(run) if e.step > 40} == {"stdlib-code", "notes"}
    assert sorted(run.read_json(STATE)["arms"]) == ["notes", "stdlib-code"]
    assert max(s["p"] for s in run.read_json(STATE)["arms"].values()) <= 0.6 + 1e-12
    assert run_status(run.url).problems == []
