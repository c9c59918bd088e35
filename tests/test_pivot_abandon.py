"""`andrea pivot --abandon` never deletes what has no byte-identical copy left (issue 23.3), clears a dead
writer's temporary file in the phase folder instead of failing on it, and `andrea inspect` of a
directory is one error line (issue 23.9)."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, _env, andrea, flock_held_elsewhere, library_run

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir

PHASE = "archive/phase_001_step_000200"


def files_of(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """andrea-tiny trained to step 200: the library's (conftest.library_run), this module's copy."""
    return library_run(tmp_path_factory, tmp_path_factory.mktemp("abandon") / "base", 200)


def pivot_killed_after(run: Path, point: str) -> None:
    killed = subprocess.run(
        [sys.executable, "-m", "andrea_core", "pivot", str(run), "--policy", "tiny-mix", "--no-restart"],
        env={**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": point},
        cwd=REPO,
        capture_output=True,
        timeout=900,
    )
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
    from test_retention import fabricated_run

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
