"""Issue 24, the one path layer (andrea_core.run.rundir): a run directory may come from someone else, so
a symlink planted in it, or a name it holds that is not run-relative, must never make a write, move,
delete or append land outside the run. Each test is an attack of the issue on the real CLI; the last
ones walk the code for any way around the layer."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.loss_log import LossWriter
from andrea_core.run.rundir import LOCK, LOSS_LOG, TARGET, RunDir, UnsafeRunPath, check_name
from tests.conftest import REPO, andrea, library_run

DATA_JSONL = "data.jsonl"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished tiny run (checkpoints at 10 and 20), copied by each test."""
    root = tmp_path_factory.mktemp("paths-base")
    every = dict(train__checkpoint_every=10, train__sample_every=10**6)
    return library_run(tmp_path_factory, root / "run", 20, "--device", "cpu", **every)  # conftest's library


def copy_run(base: Path, to: Path) -> Path:
    shutil.copytree(base, to, symlinks=True)
    return to


def test_planted_temporary_names_are_never_written_through(base, tmp_path):
    """2a: links at every temporary name the next few thousand pids would use, pointing at a victim."""
    run = copy_run(base, tmp_path / "A")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    first = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    for pid in range(first + 1, first + 3001):
        for name in (LOCK, "step_000020.bin", LOSS_LOG):
            (run / f".{name}.tmp.{pid}").symlink_to(victim)
    andrea("gc", str(run), "--keep-last", "2", check=False)
    andrea("train", "--run-dir", str(run), "--max-steps", "21", "--device", "cpu")
    assert victim.read_text() == "precious\n"
    assert json.loads((run / LOCK).read_text())["released"] is True


@pytest.mark.parametrize("name", [LOSS_LOG, DATA_JSONL])
def test_an_append_only_file_that_is_a_symlink_is_refused_not_appended_through(base, tmp_path, name):
    """2b: A/.loss.json a link to V's, A/data.jsonl a link to an outside file."""
    run = copy_run(base, tmp_path / "A")
    outside = tmp_path / "outside"
    outside.write_bytes((run / name).read_bytes() if (run / name).exists() else b"keep\n")
    before = outside.read_bytes()
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(outside)
    proc = andrea("train", "--run-dir", str(run), "--max-steps", "30", "--device", "cpu", check=False)
    assert outside.read_bytes() == before
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"andrea: error: {run / name}: a symlink where a run file should be" in proc.stderr


def test_a_refused_folder_that_is_a_symlink_receives_nothing(base, tmp_path):
    """2c: A/refused a link to an outside folder, and a truncated checkpoint to set aside."""
    run = copy_run(base, tmp_path / "A")
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "refused").symlink_to(outside, target_is_directory=True)
    bad = run / checkpoint_name(20)
    bad.write_bytes(bad.read_bytes()[:100])
    proc = andrea("train", "--run-dir", str(run), "--max-steps", "30", "--device", "cpu", check=False)
    assert list(outside.iterdir()) == []
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run / 'refused'}: a symlink or a file where a folder of the run should be" in proc.stderr


def test_gc_still_removes_only_the_links_of_symlinked_step_files(base, tmp_path):
    """Held up in the review, kept so: gc removes a step file that is a link, never what it points to."""
    run = copy_run(base, tmp_path / "A")
    outside = tmp_path / "passwd"
    outside.write_text("root:x:0:0\n")
    (run / checkpoint_name(5)).symlink_to(outside)
    andrea("gc", str(run), "--keep-last", "2", check=False)
    assert outside.read_text() == "root:x:0:0\n"


def test_run_file_reads_do_not_follow_a_symlink_or_block_on_a_fifo(base, tmp_path):
    run = copy_run(base, tmp_path / "A")
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = x\n")
    (run / "tokenizer.json").symlink_to(secret)
    os.mkfifo(run / "policy.yaml.fifo")
    r = RunDir(str(run))
    with pytest.raises(UnsafeRunPath, match="a symlink where a run file should be"):
        r.read_bytes("tokenizer.json")
    with pytest.raises(UnsafeRunPath, match="not a regular file"):
        r.read_bounded("policy.yaml.fifo")


@pytest.mark.parametrize("where", ["step_000100.bin", "a-file/run"])
def test_a_file_where_the_run_folder_should_be_holds_no_run(tmp_path, where):
    """The run's folder is a file (named like a checkpoint), or under one: every reader finds no run
    there, as on an object store, and nothing is read from the file (it was listed as the run's own
    checkpoint step_000100.bin by the listing, which asked the filesystem about the root as a path)."""
    from andrea_core.run.lineage import fork_records
    from andrea_core.run.pivot_journal import read_pivot
    from andrea_core.run.retention import protected_steps

    (tmp_path / where.split("/")[0]).write_bytes(b"not a run")
    r = RunDir(str(tmp_path / where))
    assert r.listdir() == [] and r.checkpoint_steps() == []
    assert fork_records(r) == [] and read_pivot(r) is None and protected_steps(r) == {}
    assert not r.exists(LOCK)
    with pytest.raises(FileNotFoundError, match="a file, not the run's folder"):
        r.read_bytes(LOCK)
    assert (tmp_path / where.split("/")[0]).read_bytes() == b"not a run"


@pytest.mark.parametrize(
    "bad", ["/etc/passwd", "../V/step_000100.bin", "archive/../../x", "a\0b", "", "a//b", "./x", "a/"]
)
def test_names_that_are_not_run_relative_are_refused_by_every_operation(tmp_path, bad):
    r = RunDir(str(tmp_path / "A"))
    with pytest.raises(UnsafeRunPath, match="not a run-relative name"):
        check_name(bad)
    ops = [r.path, r.remove, r.read_bytes, r.exists, lambda n: r.write_text(n, "x")]
    for op in ops + ([r.listdir] if bad else []):  # listdir("") is the root's
        with pytest.raises(UnsafeRunPath):
            op(bad)
    with pytest.raises(UnsafeRunPath):
        r.move("x", bad)
    assert not (tmp_path / "x").exists() and not (tmp_path / "V").exists()


def test_the_lock_holding_the_nonce_is_its_owners_alone(base, tmp_path):
    """10: the lock carries the trainer's secret nonce: mode 0600, whatever the umask."""
    run = copy_run(base, tmp_path / "A")
    (run / LOCK).unlink()
    andrea("train", "--run-dir", str(run), "--max-steps", "21", "--device", "cpu")
    assert (run / LOCK).stat().st_mode & 0o777 == 0o600


# --- the layer has no way around it ----------------------------------------------------------------

SOURCES = sorted(p for d in ("andrea_core", "tasks", "flows") for p in (REPO / d).rglob("*.py"))
# The path layer: RunDir and the stores it talks to (run/store.py).
PATH_LAYER = {REPO / "andrea_core" / "run" / "rundir.py", REPO / "andrea_core" / "run" / "store.py"}


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_no_code_reaches_a_run_directorys_filesystem_around_the_path_layer():
    """`run.fs.anything(...)` would skip the name check and the symlink refusal: only rundir.py may."""
    found = []
    for path in SOURCES:
        if path in PATH_LAYER:
            continue
        for node in calls(path):
            name = dotted(node.func)
            # X.fs.method(): a RunDir's filesystem (f.fs is a corpus file's, opened through the gate)
            owner = name.split(".")[:-2]
            if len(owner) >= 1 and name.split(".")[-2] == "fs" and owner != ["f"]:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}()")
    assert found == []


def test_no_code_opens_a_run_file_by_its_path():
    """open()/os.open()/Path(...).open of something built by `run.path(...)`: the layer's job."""
    found = []
    for path in SOURCES:
        if path in PATH_LAYER:
            continue
        for node in calls(path):
            if dotted(node.func) not in (
                "open",
                "os.open",
                "io.open",
                "shutil.move",
                "shutil.copy",
                "os.replace",
            ):
                continue
            for arg in ast.walk(node):
                if isinstance(arg, ast.Call) and dotted(arg.func).endswith(".path") and arg is not node:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


# --- 8: every name check is a fullmatch -------------------------------------------------------------


def test_a_branch_name_with_a_trailing_newline_is_refused(base, tmp_path):
    run = copy_run(base, tmp_path / "F")
    proc = andrea("fork", str(run), "--branch", "ok\n", "--step", "20", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["F"]


def test_every_name_pattern_refuses_a_trailing_newline():
    from andrea_core.checkpoint import NAME_RE, step_from_name
    from andrea_core.data.policy import ARM_NAME_RE
    from andrea_core.data.shards import FROZEN_ID
    from andrea_core.ops.fork import BRANCH_NAME_RE
    from andrea_core.run.lineage import PHASE_FOLDER_RE, PHASE_RE
    from andrea_core.run.rundir import TEMP_RE

    names = {
        BRANCH_NAME_RE: "ok",
        NAME_RE: "step_000100.bin",
        PHASE_RE: "phase_001_step_000100",
        PHASE_FOLDER_RE: "archive/phase_001_step_000100",
        TEMP_RE: ".x.tmp.12.0123456789abcdef",
        FROZEN_ID: "hf-0123456789abcdef",
        ARM_NAME_RE: "arm",
    }
    for pattern, good in names.items():
        assert pattern.fullmatch(good), pattern
        assert not pattern.fullmatch(good + "\n"), pattern
        # No anchors: a pattern written for fullmatch, never for match() and `$`.
        assert not pattern.pattern.startswith("^") and not pattern.pattern.endswith("$"), pattern
    assert step_from_name("step_000100.bin\n") is None


# --- issue 43.9 (review): hard links ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [TARGET, "guard.jsonl", "tensorboard/events.out.tfevents.1.host"])
def test_an_append_through_a_hard_link_to_a_file_outside_the_run_is_refused(tmp_path, name):
    run = RunDir(tmp_path / "run")
    run.makedirs("tensorboard")
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"the victim's own bytes\n")
    os.link(outside, tmp_path / "run" / name)
    with pytest.raises(UnsafeRunPath, match=r"a hard link \(2 links\) where a run file should be"):
        run.append(name, b'{"max_steps": 500, "by": "andrea pivot"}\n', lines=not name.startswith("tensor"))
    assert outside.read_bytes() == b"the victim's own bytes\n"


def test_the_loss_log_and_a_trainer_log_are_never_written_through_a_hard_link(tmp_path):
    run = RunDir(tmp_path / "run")
    run.makedirs()
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"x\n")
    os.link(outside, tmp_path / "run" / LOSS_LOG)
    with pytest.raises(UnsafeRunPath, match="hard link"):
        LossWriter(run, warn=lambda m: None)
    os.link(outside, tmp_path / "run" / "trainer.log")
    with pytest.raises(UnsafeRunPath, match="hard link"):
        run.open_log("trainer.log")
    assert outside.read_bytes() == b"x\n" and os.stat(outside).st_nlink == 3
    # A file of the run with one link is appended to as ever; a whole-file write replaces a link.
    run.append("data.jsonl", b'{"a": 1}\n')
    run.write_text(LOSS_LOG, "")
    assert outside.read_bytes() == b"x\n" and (tmp_path / "run" / "data.jsonl").read_bytes() == b'{"a": 1}\n'
