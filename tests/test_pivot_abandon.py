"""`andrea pivot --abandon` never deletes what has no byte-identical copy left (issue 23.3), clears a dead
writer's temporary file in the phase folder instead of failing on it, and `andrea inspect` of a
directory is one error line (issue 23.9); the run's target across a pivot, and the pivot's waits for a
pivot process that still runs and for a trainer elsewhere (issue 43.1-43.5)."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    _env,
    andrea,
    flock_held_elsewhere,
    last_logged_step,
    library_run,
    refused,
    start_trainer,
    wait_for,
)
from test_retention import fabricated_run
from tiny import tiny_config

from andrea_core.data.policy import load_policy
from andrea_core.ops.pivot import PivotJournal
from andrea_core.ops.supervise import LossLogSnapshot
from andrea_core.run.lock import TrainerIdentity
from andrea_core.run.loss_log import read_history
from andrea_core.run.pivot_journal import PIVOT_JSON, read_pivot
from andrea_core.run.record import read_run
from andrea_core.run.rundir import LOCK, TARGET, RunDir
from andrea_core.run.target import read_target

PHASE = "archive/phase_001_step_000200"


def files_of(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """andrea-tiny trained by `andrea train --max-steps 200` (its lock records that command line): the
    library's (conftest.library_run), this module's copy."""
    return library_run(tmp_path_factory, tmp_path_factory.mktemp("abandon") / "base", 200)


def pivot_killed_after(run: Path | str, point: str, *extra: str) -> None:
    # The kill point is read at run time, not at import: a warm start (conftest.andrea) behaves the same.
    env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": point}
    killed = andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart", *extra, env=env, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


@pytest.mark.slow
def test_abandon_after_the_new_phase_trained_refuses_and_changes_nothing(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    old = {n: (trained / n).read_bytes() for n in (".samples.json", ".state.json", "policy.yaml")}
    pivot_killed_after(run, "installed")
    andrea("train", "--run-dir", str(run), "--max-steps", "300")  # the new phase (allowed at "installed")
    assert (run / "step_000300.bin").exists() and (run / ".state.json").read_bytes() != old[".state.json"]
    before = files_of(run)
    proc = andrea("pivot", str(run), "--abandon", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert err.startswith("andrea: error: ") and err.count("\n") == 1, err
    assert "the new phase trained steps 201..300" in err and "abandoning would discard them" in err, err
    assert f"andrea pivot {run} --policy tiny-mix" in err, err
    assert files_of(run) == before, "a refused abandon changed the run"
    for name, data in old.items():  # the old phase is still whole in its archive
        assert (run / PHASE / name).read_bytes() == data
    andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")  # finishing it works
    assert (
        not (run / "pivot.json").exists() and (run / PHASE / ".state.json").read_bytes() == old[".state.json"]
    )


@pytest.mark.slow
def test_abandon_clears_a_dead_writers_temporary_file_in_the_phase_folder(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = files_of(run)
    pivot_killed_after(run, "archive-move-1")
    # What a SIGKILL during the archive's write of policy.yaml leaves (pid of the dead pivot).
    temporary = run / PHASE / ".policy.yaml.tmp.4194000"
    temporary.write_bytes(b"name: half-writ")
    # While a live process holds its flock (a pivot of this run writing there, from another pid
    # namespace: its pid means nothing here), abandon refuses and changes nothing.
    with flock_held_elsewhere(temporary):
        mid = files_of(run)
        proc = andrea("pivot", str(run), "--abandon", check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"{run / PHASE}: {temporary.name} is being written by a live process" in proc.stderr, (
            proc.stderr
        )
        assert files_of(run) == mid
    out = andrea("pivot", str(run), "--abandon")
    assert "left by a writer that did not finish" in out.stdout, out.stdout
    assert files_of(run) == before and not (run / PHASE).exists()
    andrea("train", "--run-dir", str(run), "--max-steps", "201")  # the old phase trains on
    assert read_history(RunDir(str(run)))[-1].step == 201


def test_abandon_refuses_a_phase_folder_holding_a_file_it_does_not_know(tmp_path):

    from andrea_core.data.policy import load_policy
    from andrea_core.ops.pivot import parse_policy_text
    from andrea_core.run.pivot_journal import record_pivot

    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    policy = parse_policy_text(load_policy("tiny-mix")[1], "tiny-mix")
    record_pivot(run, policy, "archiving", 200, archive=PHASE, policy_text=load_policy("tiny-mix")[1])
    run.write_text(f"{PHASE}/notes.txt", "an operator's notes")
    before = files_of(tmp_path / "run")
    proc = andrea("pivot", run.url, "--abandon", check=False)
    assert proc.returncode == 2 and "notes.txt, which no pivot writes there" in proc.stderr, proc.stderr
    assert files_of(tmp_path / "run") == before
    assert json.loads((tmp_path / "run" / "pivot.json").read_text())["step"] == "archiving"


def test_inspect_of_a_directory_is_one_error_line(tmp_path):
    proc = andrea("inspect", str(tmp_path), check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"andrea: error: {tmp_path}: a directory") and proc.stderr.count("\n") == 1
    assert "step_000100.bin" in proc.stderr and "Traceback" not in proc.stderr


# --- the target and the pivot (issue 43.1-43.5, review findings): a pivot without --max-steps trains to
# the run's newest target; --abandon waits for a pivot process that still runs and brings the old target
# back; a refused `andrea train` touches nothing; a pivot aimed at a dead trainer elsewhere ends its wait
# with the way forward, and its stop wait honours --timeout.


def copy(trained: Path, tmp_path: Path) -> RunDir:
    return RunDir(str(shutil.copytree(trained, tmp_path / "run")))


def target_of(run: RunDir) -> int:
    return read_target(run, read_run(run).config.train.max_steps).max_steps


def test_a_pivot_without_max_steps_trains_to_the_newest_target(trained, tmp_path):
    """43.1: the second pivot took the stopped trainer's old --max-steps (200, from its lock) as the
    target and appended {"max_steps": 200, "by": "andrea pivot"} over the first pivot's 500."""
    run = copy(trained, tmp_path)
    andrea("pivot", run.url, "--policy", "tiny-mix", "--no-restart", "--max-steps", "500")
    assert target_of(run) == 500
    andrea("pivot", run.url, "--policy", "stdlib-only", "--no-restart")
    assert target_of(run) == 500
    lines = [json.loads(line) for line in run.read_bytes(TARGET).splitlines()]
    assert [line["max_steps"] for line in lines if line["by"] == "andrea pivot"] == [500]


def test_a_refused_train_touches_neither_the_target_nor_the_lock(trained, tmp_path):
    """43.3: a trainer refused by a half-done pivot appended its --max-steps to target.jsonl and
    rewrote the lock with its own command line (which a later pivot restart would reuse)."""
    run = copy(trained, tmp_path)
    pivot_killed_after(run.url, "stopped")
    assert read_pivot(run)["step"] == "stopped"
    before = {name: run.read_bytes(name) if run.exists(name) else None for name in (TARGET, LOCK)}
    refused = andrea("train", "--run-dir", run.url, "--max-steps", "999", check=False)
    assert refused.returncode == 2 and "is half done" in refused.stderr, refused.stdout + refused.stderr
    assert {name: run.read_bytes(name) if run.exists(name) else None for name in (TARGET, LOCK)} == before


def test_abandon_brings_back_the_old_phase_target(trained, tmp_path):
    """43.4: the abandoned pivot's target (900) stayed in force under the old policy."""
    run = copy(trained, tmp_path)
    before = target_of(run)
    pivot_killed_after(run.url, "installed", "--max-steps", "900")
    assert target_of(run) == 900
    out = andrea("pivot", run.url, "--abandon")
    assert f"the run's target is {before} again" in out.stdout, out.stdout
    assert target_of(run) == before and not run.exists(PIVOT_JSON)


def test_abandon_refuses_while_the_pivot_process_still_runs(tmp_path):
    """43.2: `--abandon` while another `andrea pivot` waited for its boundary said "abandoned ...
    restored nothing" (exit 0); that pivot then stopped the trainer and installed its policy anyway."""
    run = RunDir(str(tmp_path / "live"))  # its boundary (step 1000) far ahead: the pivot waits for it
    config = tiny_config(tmp_path, train__checkpoint_every=1000)
    trainer = start_trainer(
        "--config", config, "--run-dir", run.url, "--max-steps", "100000", "--pace", "0.05"
    )
    pivot = None
    try:
        wait_for(lambda: run.exists(LOCK) and run.read_bytes(LOCK) and not _released(run), what="trainer")
        pivot = subprocess.Popen(
            [sys.executable, "-m", "andrea_core", "pivot", run.url, "--policy", "tiny-mix", "--no-restart"],
            cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(lambda: (read_pivot(run) or {}).get("step") == "intent", timeout=300, what="the intent")
        refused = andrea("pivot", run.url, "--abandon", check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"still being run by process {pivot.pid}" in refused.stderr, refused.stderr
        assert read_pivot(run)["step"] == "intent" and pivot.poll() is None
        pivot.kill()  # a pivot that died: abandon goes ahead
        pivot.wait()
        assert "abandoned the pivot" in andrea("pivot", run.url, "--abandon").stdout
    finally:
        if pivot is not None and pivot.poll() is None:
            pivot.kill()
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)


def _released(run: RunDir) -> bool:
    return json.loads(run.read_bytes(LOCK)).get("released", False)


def forge_remote_lock(run: RunDir, ttl: float) -> None:
    """The lock of a trainer on another machine whose lease was last renewed now (and never again)."""
    now = time.time()
    ident = TrainerIdentity(
        4242, "elsewhere", "another-boot", 1, now, run.url, "pid:[1]", "nonce", generation=2,
        lease_ttl_s=ttl, lease_renew_s=ttl / 3, renewals=5, renewed_at=now,
    )  # fmt: skip
    run.write_atomic(LOCK, ident.encode())


def test_a_pivot_aimed_at_a_dead_trainer_elsewhere_ends_its_wait_with_the_way_forward(trained, tmp_path):
    """43.5: the pivot waited out its whole --timeout ("did not appear within ..."), the lock unchanged."""
    run = copy(trained, tmp_path)
    forge_remote_lock(run, ttl=1.0)
    t0 = time.monotonic()
    proc = andrea("pivot", run.url, "--policy", "tiny-mix", "--no-restart", "--timeout", "150", check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "has not renewed its lease for" in proc.stderr and "twice its ttl of 1s" in proc.stderr
    assert f"andrea train --run-dir {run.url} takes over the expired lease" in proc.stderr
    assert took < 120, f"waited {took:.0f}s"
    assert not run.exists(PIVOT_JSON) and not run.exists("archive")  # nothing changed


def test_the_pivot_stop_wait_honours_its_timeout(trained, tmp_path):
    """43.5: run_pivot stopped the trainer with a fixed 300 s whatever --timeout said."""
    run = copy(trained, tmp_path)
    forge_remote_lock(run, ttl=600.0)  # alive as far as its lease says: the stop is waited for
    policy, text = load_policy("tiny-mix")
    journal = PivotJournal(
        policy.name, policy.hash, text, "tiny-mix", "boundary", "none", 200,
        loss_before=LossLogSnapshot.take(run),
    )  # fmt: skip
    journal.record(run, "checkpointed", boundary=200)
    t0 = time.monotonic()
    proc = andrea(
        "pivot", run.url, "--policy", "tiny-mix", "--no-restart", "--timeout", "3", check=False, timeout=200
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "still runs 3s after SIGTERM" in proc.stderr, proc.stderr
    assert took < 150, f"waited {took:.0f}s"


# --- the CLI pivot: refusals (issue 30: a promise no test held the code to)


@pytest.fixture(scope="module")
def trained_20(tmp_path_factory):
    """andrea-tiny trained to step 20 (checkpoints 10 and 20, no sample audit): the library's
    (conftest.library_run, the recipe of test_fork, test_security_paths and test_security_pivot: one
    training for all), this module's copy."""
    run = tmp_path_factory.mktemp("trained-20") / "run"
    every = dict(train__checkpoint_every=10, train__sample_every=10**6)
    return library_run(tmp_path_factory, run, 20, "--device", "cpu", **every)


def tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_cli_pivot_refuses_a_max_steps_not_beyond_the_run_before_touching_it(trained_20):
    before = tree(trained_20)
    for max_steps in ("20", "5"):
        proc = andrea("pivot", str(trained_20), "--policy", "tiny-mix", "--max-steps", max_steps, check=False)
        refused(proc, f"max_steps {max_steps} is not beyond", "step 20", "pass a larger max_steps")
    assert tree(trained_20) == before


@pytest.mark.slow
def test_abandon_is_refused_while_a_trainer_runs_and_the_journal_kept(trained_20, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_20, run)
    trainer = start_trainer("--run-dir", str(run), "--max-steps", "100000", "--pace", "0.1")
    try:
        wait_for(lambda: last_logged_step(run) > 20, timeout=300, what="the trainer's first step")
        # The pivot has installed its policy and restarted the trainer: past the point --abandon undoes.
        now = time.time()
        journal = {"format": 1, "policy": "tiny-mix", "policy_hash": load_policy("tiny-mix")[0].hash,
                   "boundary": 20, "not_before": None, "step": "installed", "started_at": now,
                   "updated_at": now}  # fmt: skip
        (run / PIVOT_JSON).write_text(json.dumps(journal))
        before = tree(run)
        proc = andrea("pivot", str(run), "--abandon", check=False)
        refused(proc, f"trainer pid {trainer.pid} is running", "'installed'", "stop it before abandoning")
        assert (run / PIVOT_JSON).read_bytes() == before[PIVOT_JSON] and trainer.poll() is None
    finally:
        trainer.kill()
        trainer.wait()
