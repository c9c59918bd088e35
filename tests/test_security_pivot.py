"""Issue 24, finding 1: a forged pivot.json must not make `andrea pivot --abandon` or a pivot rerun
delete, move or write outside the run, nor install a policy text nobody checked. The journal holds
run-relative names only, checked on read (run/pivot_journal.read_pivot); its policy text is re-hashed
and re-validated like any policy (ops/pivot.begin_pivot)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from andrea_core.data.policy import load_policy
from andrea_core.ops.supervise import LossLogSnapshot
from andrea_core.run.rundir import RunDir
from tests.conftest import andrea, library_run

PHASE = "archive/phase_001_step_000010"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pivot-base")
    every = dict(train__checkpoint_every=10, train__sample_every=10**6)
    return library_run(tmp_path_factory, root / "run", 20, "--device", "cpu", **every)  # conftest's library


def victim(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Run V: an archived phase and the files an attacker wants gone or moved."""
    v = tmp_path / "V"
    files = {
        f"{PHASE}/.samples.json": b"{}\n",
        f"{PHASE}/.state.json": b'{"v": 1}\n',
        f"{PHASE}/step_000300.bin": b"V's checkpoint",
        f"{PHASE}/policy.yaml": b"name: v\n",
        "step_000100.bin": b"V's newest",
        ".state.json": b'{"v": 2}\n',
        "policy.yaml": b"name: v-now\n",
    }
    for name, data in files.items():
        (v / name).parent.mkdir(parents=True, exist_ok=True)
        (v / name).write_bytes(data)
    return v, files


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def forge(run: Path, **fields) -> None:
    doc = {"format": 1, "policy": "stdlib-only", "policy_hash": "0" * 16, "boundary": 10, "not_before": None}
    (run / "pivot.json").write_text(json.dumps({**doc, **fields}))


def test_abandon_of_a_journal_naming_another_runs_archive_touches_nothing(base, tmp_path):
    """1a: "archive" an absolute path into run V."""
    run = shutil.copytree(base, tmp_path / "A")
    v, files = victim(tmp_path)
    forge(run, step="archived", archive=str(v / PHASE))
    proc = andrea("train", "--run-dir", str(run), "--max-steps", "30", "--device", "cpu", check=False)
    assert proc.returncode == 2 and "pivot.json" in proc.stderr
    proc = andrea("pivot", str(run), "--abandon", check=False)
    assert tree(v) == files
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"archive {str(v / PHASE)!r} is not a phase folder of this run" in proc.stderr


def test_abandon_through_a_symlinked_phase_folder_touches_nothing(base, tmp_path):
    """1b: A/archive/phase_001_step_000010 a symlink to V's root."""
    run = shutil.copytree(base, tmp_path / "A")
    v, files = victim(tmp_path)
    (run / "archive").mkdir()
    (run / PHASE).symlink_to(v, target_is_directory=True)
    forge(run, step="archived", archive=PHASE)
    proc = andrea("pivot", str(run), "--abandon", check=False)
    assert tree(v) == files
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run / PHASE}: a symlink or a file where a folder of the run should be" in proc.stderr


def test_a_rerun_of_a_journal_naming_an_outside_archive_creates_nothing_there(base, tmp_path):
    """1c: "archive" an absolute path outside every run, at step "stopped"."""
    run = shutil.copytree(base, tmp_path / "A")
    outside = tmp_path / "some" / "outside" / "dir"
    policy = load_policy("stdlib-only")[0]
    forge(run, step="stopped", archive=f"{outside}/phase_001_step_000010", policy_hash=policy.hash)
    before = tree(run)
    proc = andrea("pivot", str(run), "--policy", "stdlib-only", "--no-restart", check=False)
    assert not (tmp_path / "some").exists()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert tree(run) == before


def test_a_rerun_never_installs_a_policy_text_its_recorded_hash_does_not_match(base, tmp_path):
    """1d: the journal's policy_hash is the operator's policy's, its policy_text something else."""
    run = shutil.copytree(base, tmp_path / "A")
    for name in (".state.json", ".samples.json"):
        (run / name).unlink(missing_ok=True)
    policy, text = load_policy("stdlib-only")
    forged = text.replace("name: stdlib-only", "name: forged") + "# not what the operator checked\n"
    taken = LossLogSnapshot.take(RunDir(str(run)))
    snapshot = {"size": taken.size, "sha256": taken.sha256, "segments": taken.segments}
    (run / "archive" / "phase_001_step_000020").mkdir(parents=True)
    forge(
        run,
        step="loss-kept",
        boundary=20,
        archive="archive/phase_001_step_000020",
        policy_hash=policy.hash,
        policy_text=forged,
        source="stdlib-only",
        restart="none",
        at="boundary",
        max_steps=40,
        loss_at_stop=snapshot,
        loss_before=snapshot,
    )
    installed = (run / "policy.yaml").read_bytes()
    proc = andrea("pivot", str(run), "--policy", "stdlib-only", "--no-restart", check=False)
    assert (run / "policy.yaml").read_bytes() == installed
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "its policy_text hashes to" in proc.stderr and policy.hash in proc.stderr


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"step": "archived", "archive": "../B/archive/phase_001_step_000010"}, "is not a phase folder"),
        ({"step": "archived", "archive": "archive/phase_001_step_000010\n"}, "is not a phase folder"),
        ({"step": "archived", "archive": ["archive"]}, "is not a phase folder"),
        ({"step": "flying"}, "step 'flying' is not a pivot step"),
        ({"step": "archived", "boundary": -5}, "boundary -5 is not a step"),
        ({"step": "archived", "boundary": True}, "boundary True is not a step"),
    ],
)
def test_the_journal_is_checked_when_read(tmp_path, fields, problem):
    from andrea_core.run.pivot_journal import read_pivot

    run = tmp_path / "A"
    run.mkdir()
    forge(run, **fields)
    doc = read_pivot(RunDir(str(run)))
    assert set(doc) == {"unreadable"} and problem in doc["unreadable"], doc
