"""Pivot defects (issue 15.2, 15.3, 15.11, 15.12): everything checked before the run is touched, a resumed
trainer's death seen at once, the pivot point protected from retention, and `at: now` after a
crash-resume. The flows run in Prefect's ephemeral mode, as in the review."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import _env, andrea, start_trainer, wait_for
from prefect_ephemeral import ephemeral_prefect  # noqa: F401
from test_retention import fabricated_run

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import ConfigError, RetentionConfig
from andrea_core.data.policy import load_policy
from andrea_core.ops.pivot import install_policy
from andrea_core.ops.supervise import (
    LossLogSnapshot,
    SupervisionError,
    TrainerProcess,
    logged_step,
    wait_for_first_entry_after,
    wait_for_new_checkpoint,
)
from andrea_core.run.lock import live_trainer
from andrea_core.run.loss_log import read_history
from andrea_core.run.pivot_journal import PIVOT_JSON, clear_pivot, record_pivot
from andrea_core.run.retention import apply_retention
from andrea_core.run.rundir import LOSS_LOG, RunDir
from tests.tiny import tiny_config


def half_policy(folder: Path) -> str:
    """The issue's policy: feasible as written, but its prose arm's path does not exist, and the arm left
    is capped at 0.5. A pivot or a trainer's first load of it refuses the unavailable arm (pipeline's
    require_available); a run that loses an arm later trains on with the caps scaled (issue 43.8)."""
    path = folder / "half.yaml"
    path.write_text(
        "name: half\nmixer: exp3\narms:\n"
        "  - {name: stdlib-code, kind: python-stdlib, cap: 0.5}\n"
        f"  - {{name: gone, kind: prose, cap: 0.5, paths: [{folder}/no-such-folder]}}\n"
    )
    return str(path)


def files_of(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "params,error",
    [
        ({"policy": "HALF"}, r"arm 'gone' is unavailable"),
        pytest.param(
            {"restart": "subflow", "device": "cuda"},
            r"--device cuda: CUDA is not available on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has the device"),
        ),
        (
            {"restart": "subflow", "max_steps": 200},
            r"max_steps 200 is not beyond the run's newest checkpoint",
        ),
        ({"restart": "subflow"}, r"max_steps 300 is not beyond the run's newest checkpoint \(step 300\)"),
        (
            {"restart": "deployment", "max_steps": 1000, "train_deployment": "train/no-such"},
            r"train_deployment 'train/no-such' does not exist",
        ),
    ],
)
@pytest.mark.usefixtures("ephemeral_prefect")
def test_a_pivot_refuses_before_touching_the_run(tmp_path, params, error):
    from flows.pivot import pivot

    run = fabricated_run(str(tmp_path / "run"), [100, 200, 300])
    params = {"policy": "tiny-mix", "restart": "none", **params}
    if params["policy"] == "HALF":
        params["policy"] = half_policy(tmp_path)
    before = files_of(tmp_path / "run")
    with pytest.raises(ConfigError, match=error):
        pivot(run.url, **params)
    assert files_of(tmp_path / "run") == before


def test_a_resumed_trainer_that_dies_is_reported_at_once_with_its_error(tmp_path):
    """The trainer refuses the policy in force; whoever waits for its first step hears why at once
    (here through a subflow-like future, as the pivot's restart='subflow' does)."""
    from tasks.pivot import subflow_ended

    run = fabricated_run(str(tmp_path / "run"), [100])
    # Past any pivot check: a policy whose only arm has no data here (one arm of several gone trains on
    # with the caps scaled, issue 43.8; none left is refused at every start).
    gone = (
        "name: gone\nmixer: exp3\narms:\n  - {name: gone, kind: prose, cap: 1.0, paths: [/no-such-folder]}\n"
    )
    install_policy(run, gone)
    snapshot = LossLogSnapshot.take(run)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: TrainerProcess(run.url, max_steps=200, device="cpu").start().finish(600))
        future_dict = pool.submit(lambda: future.result().to_dict())
        t0 = time.monotonic()
        with pytest.raises(SupervisionError) as raised:
            wait_for_first_entry_after(run, snapshot, timeout=600, ended=subflow_ended(future_dict))
    assert time.monotonic() - t0 < 120, "not the 600 s timeout"
    message = str(raised.value)
    assert message.startswith(
        f"{run.url}: the trainer ended before logging a step: {run.url}: trainer failed"
    )
    assert "no source files found" in message, message


def test_retention_keeps_the_checkpoint_of_a_pivot_under_way(tmp_path):
    run = fabricated_run(str(tmp_path / "run"), [100, 200, 300, 400, 500])
    policy, _ = load_policy("tiny-mix")
    cfg = RetentionConfig(keep_last=2, keep_every=None)
    record_pivot(run, policy, "intent", None, not_before=250)  # at="now": the SIGUSR1 checkpoint is >= 250
    plan = apply_retention(run, cfg, None, dry_run=True)
    assert plan.delete == [100, 200]
    assert plan.keep[300] == ["pivot under way (to policy 'tiny-mix', step 'intent')"]
    record_pivot(run, policy, "stopped", 300)
    doc = run.read_json(PIVOT_JSON)
    assert {k: doc[k] for k in ("format", "policy", "policy_hash", "boundary", "not_before", "step")} == {
        "format": 1,
        "policy": "tiny-mix",
        "policy_hash": policy.hash,
        "boundary": 300,
        "not_before": None,
        "step": "stopped",
    }
    plan = apply_retention(run, cfg, None)
    assert plan.deleted == [100, 200] and run.checkpoint_steps() == [300, 400, 500]
    clear_pivot(run)
    assert apply_retention(run, cfg, None).deleted == [300]
    run.write_text(PIVOT_JSON, "{torn")
    assert apply_retention(run, cfg, None).deleted == []  # an unreadable record protects everything


def _fast_trainer(tmp_path: Path) -> subprocess.Popen:
    """A trainer of tmp_path/run that checkpoints every step and keeps the newest two: retention deletes
    a checkpoint two steps after it is written, the window a pivot's boundary races (the guard off: its
    rollback point would keep the newest 69)."""
    config = tiny_config(
        tmp_path,
        train__checkpoint_every=1,
        retention__keep_last=2,
        retention__keep_every=None,
        train__guard__enabled=False,
    )
    run_dir = str(tmp_path / "run")
    return start_trainer("--config", config, "--run-dir", run_dir, "--max-steps", "100000", "--pace", "0.05")


def _pivot_live(run: RunDir, trainer: subprocess.Popen, ready, what: str) -> tuple[dict, str]:
    """Once the trainer holds the run and `ready()`, `andrea pivot --no-restart` to tiny-mix of the live
    run, in this process (a test's monkeypatches apply); the trainer stopped whatever happens.
    (result, the pivot's log)."""
    from andrea_core.ops.pivot import check_pivot, run_pivot

    lines: list[str] = []
    try:
        wait_for(lambda: live_trainer(run) and ready(), timeout=300, what=what)
        checked = check_pivot(run, "tiny-mix", restart=False, warn=lines.append)
        result = run_pivot(run, checked, restart=None, timeout_s=120, log=lines.append)
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    return result, "\n".join(lines)


@pytest.mark.slow
@pytest.mark.usefixtures("ephemeral_prefect")
def test_a_pivot_at_a_boundary_with_checkpoints_every_step_and_keep_last_2(tmp_path):
    """The issue's setting: with checkpoint_every 1 and keep_last 2 the boundary's checkpoint would be
    deleted between the wait and the SIGTERM; the pivot protects it first."""
    from flows.pivot import pivot

    run, trainer = RunDir(tmp_path / "run"), _fast_trainer(tmp_path)
    try:
        wait_for(lambda: live_trainer(run) and logged_step(run), timeout=300, what="the first steps")
        result = pivot(run.url, "tiny-mix", at="boundary", restart="none")
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    boundary = result["boundary"]
    assert run.checkpoint_steps()[-1] == boundary and not run.exists(PIVOT_JSON)
    run.read_checkpoint(boundary)
    assert result["stopped"]["step"] >= boundary


@pytest.mark.slow
def test_a_boundary_the_trainer_passed_before_the_pivot_protected_it_is_decided_again(tmp_path, monkeypatch):
    """The soak's fault 349 (2026-12-02, a 42-step/s trainer, checkpoint_every 5, keep_last 3): the
    pivot read the trainer's step, and by the time its intent was on disk the trainer had written the
    boundary's checkpoint and retention had removed it, so the pivot waited out its timeout for a file
    that could never appear. Here its first view of the trainer is 20 steps old: the pivot sees the
    trainer publish past that boundary, decides again from where the trainer is, and pivots there."""
    from andrea_core.ops import pivot as ops_pivot
    from andrea_core.ops.pivot import boundary_after

    run, trainer = RunDir(tmp_path / "run"), _fast_trainer(tmp_path)
    real, stale = ops_pivot.choose_boundary, []

    def slow_view(rd: RunDir) -> tuple[int, int]:
        decided_at, boundary = real(rd)
        if stale:
            return decided_at, boundary
        stale.append(boundary_after(decided_at - 20, 1))  # what a view 20 steps old decides
        return decided_at - 20, stale[0]

    monkeypatch.setattr(ops_pivot, "choose_boundary", slow_view)
    result, text = _pivot_live(run, trainer, lambda: (logged_step(run) or 0) > 30, "30 steps")
    assert f"pivot decided at step {stale[0]}: pivoting at step {stale[0]}" in text, text
    # The stale boundary's checkpoint was written (and removed) before the intent: decided again.
    assert f"before the intent protected {checkpoint_name(stale[0])}" in text and "deciding again" in text, (
        text
    )
    boundary = result["boundary"]
    assert boundary > stale[0] and not run.exists(checkpoint_name(stale[0]))
    assert f"pivot checkpoint {checkpoint_name(boundary)} is valid" in text
    assert run.checkpoint_steps()[-1] == boundary and not run.exists(PIVOT_JSON)
    assert run.read_checkpoint(boundary).step == boundary
    assert len(run.listdir("archive")) == 1  # one phase: the pivot happened once, at the new boundary


@pytest.mark.slow
def test_a_boundary_written_before_the_intent_is_never_the_pivot_point(tmp_path, monkeypatch):
    """The soak's fault 396 (2026-12-04, local, seed 1): the pivot decided a boundary whose checkpoint
    the trainer had already written (its view of the trainer a few steps old), saw it valid and
    stopped the trainer; but a retention pass of the trainer had read the protections just before the
    intent was on disk, and deleted that checkpoint after the pivot saw it. The pivot then failed on
    "step_045605.bin: no such file" with pivot.json at "archiving": a half-done pivot no rerun could
    finish, every trainer start refused. Here the pivot's first view decides the newest checkpoint on
    disk, and the retention pass the trainer has under way (planned with the protections read then:
    the checkpoint is one it deletes) deletes it right after the pivot has seen it valid. The pivot
    must decide again and pivot at a checkpoint written after its intent."""
    from andrea_core.ops import pivot as ops_pivot
    from andrea_core.ops import supervise
    from andrea_core.run.record import read_run
    from andrea_core.run.retention import plan_retention, protected_steps

    run, trainer = RunDir(tmp_path / "run"), _fast_trainer(tmp_path)
    real_choose, real_wait, stale = ops_pivot.choose_boundary, supervise.wait_for_checkpoint, []

    def written_boundary(rd: RunDir) -> tuple[int, int]:
        if stale:
            return real_choose(rd)
        newest = rd.checkpoint_steps()[-1]
        # The trainer's retention pass after two more checkpoints, its protections read now, before
        # the intent: it deletes `newest`.
        steps = sorted({*rd.checkpoint_steps(), newest + 1, newest + 2})
        plan = plan_retention(steps, read_run(rd).config.retention, protected_steps(rd), newest + 2)
        assert newest in plan.delete, plan
        stale.append(newest)
        return newest, newest

    def seen_valid_then_deleted(rd: RunDir, step: int, *args, **kwargs):
        ckpt = real_wait(rd, step, *args, **kwargs)
        if step == stale[0]:
            rd.remove(checkpoint_name(step))  # the pass deletes what it planned
        return ckpt

    monkeypatch.setattr(ops_pivot, "choose_boundary", written_boundary)
    monkeypatch.setattr(supervise, "wait_for_checkpoint", seen_valid_then_deleted)
    result, text = _pivot_live(run, trainer, lambda: len(run.checkpoint_steps()) >= 2, "2 checkpoints")
    assert f"pivot decided at step {stale[0]}: pivoting at step {stale[0]}" in text, text
    assert f"before the intent protected {checkpoint_name(stale[0])}" in text and "deciding again" in text, (
        text
    )
    boundary = result["boundary"]
    assert boundary > stale[0] and f"pivot checkpoint {checkpoint_name(boundary)} is valid" in text, text
    assert run.checkpoint_steps()[-1] == boundary and run.read_checkpoint(boundary).step == boundary
    assert not run.exists(PIVOT_JSON) and len(run.listdir("archive")) == 1


@pytest.mark.usefixtures("ephemeral_prefect")
def test_a_pivot_killed_after_it_completed_and_rerun_is_done_once(tmp_path):
    """The soak's fault 121 (2026-12-04, local, seed 1): `andrea pivot --no-restart` killed after it had
    completed (journal cleared) but before it exited; the operator's rerun of the same command pivoted
    again and closed an empty second phase at the same boundary. A rerun (from the shell or the flow)
    of a pivot that nothing has trained after is done already: exit 0, nothing written; asked to restart
    with no trainer running it refuses, naming the command that starts one."""
    from flows.pivot import pivot

    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    for name, data in {".samples.json": b'{"samples": 1}\n', ".state.json": b'{"state": 2}\n'}.items():
        run.write_atomic(name, data)
    argv = ["pivot", run.url, "--policy", "tiny-mix", "--no-restart"]
    killed = andrea(*argv, check=False, env={**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "finished"})
    assert killed.returncode == -signal.SIGKILL
    assert run.listdir("archive") == ["phase_001_step_000200"] and not run.exists(PIVOT_JSON)

    def tree() -> dict[str, bytes]:
        root = Path(run.url)
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    before = tree()
    again = andrea(*argv)
    assert "policy 'tiny-mix' is already in force" in again.stdout and "nothing to do" in again.stdout
    assert (
        f"pivoted {run.url} at step 200 to policy 'tiny-mix' already (nothing trained since)" in again.stdout
    )
    refused = andrea("pivot", run.url, "--policy", "tiny-mix", check=False)  # restart: no trainer runs
    assert refused.returncode == 2 and "no trainer is running" in refused.stderr, refused.stderr
    assert f"andrea train --run-dir {run.url}" in refused.stderr
    state = pivot(run.url, "tiny-mix", restart="none", return_state=True)
    assert state.is_completed() and "already in force since step 200" in state.message
    assert tree() == before  # nothing written by any of the three: one pivot, one phase


@pytest.mark.slow
def test_at_now_right_after_a_crash_resume_waits_for_the_new_segments_checkpoint(tmp_path):
    """The dead timeline logged to 300 after its last checkpoint (200); a resumed trainer that has not
    logged yet is at 200, not 300, and the SIGUSR1 checkpoint it writes (201) is the one to wait for."""
    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    lines = [
        f'{{"step":{s},"loss":3.0,"lr":0.001,"arm":"stdlib-code","tokens":512,"segment":1,"time":{time.time():.3f}}}'
        for s in range(1, 301)
    ]
    run.write_text(LOSS_LOG, "\n".join(lines) + "\n")
    assert logged_step(run) == 300  # no live trainer: the history's newest step
    trainer = start_trainer("--run-dir", run.url, "--max-steps", "100000", "--pace", "0.2")
    try:
        ident = wait_for(lambda: live_trainer(run), timeout=300, what="the resumed trainer's lock")
        ident.signal(signal.SIGSTOP)  # while it loads: it has not logged its first step yet
        if read_history(run)[-1].segment == 1:
            assert logged_step(run) == 200
        at_signal, existing = logged_step(run), set(run.checkpoint_steps())
        ident.signal(signal.SIGCONT)
        ident.signal(signal.SIGUSR1)
        ckpt = wait_for_new_checkpoint(run, at_signal, existing, timeout=120, trainer=ident)
        assert ckpt.step in (201, 202)
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGCONT)  # a failed assertion may leave it stopped
            trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    assert andrea("loss", run.url).returncode == 0 and checkpoint_name(ckpt.step) in run.listdir()


@pytest.mark.slow
@pytest.mark.usefixtures("ephemeral_prefect")
def test_an_unknown_at_or_restart_is_refused_before_the_pivot_starts(tmp_path):
    """The flow has no check of its own: Prefect validates the Literal parameters of a direct call before
    the body runs (a deployment run is refused at submission: test_prefect_flows.py), so nothing moves."""
    from prefect.exceptions import ParameterTypeError

    from flows.pivot import pivot

    run = fabricated_run(str(tmp_path / "run"), [100])
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    expected = (
        r"\n - at: Input should be 'boundary' or 'now'\n"
        r" - restart: Input should be 'deployment', 'subflow' or 'none'"
    )
    with pytest.raises(ParameterTypeError, match=expected):
        pivot(run.url, "tiny-mix", at="later", restart="never")
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
