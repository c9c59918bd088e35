"""Issue 24, finding 7: one schema check of the lock (run/lock.LOCK_SCHEMA): every field typed and
bounded, so a forged .trainer.json gives one clear refusal naming the field, never a wait without end
or a traceback, and nothing it holds reaches a terminal unescaped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from andrea_core.run.lock import read_lock
from andrea_core.run.rundir import LOCK, RunDir
from tests.conftest import andrea
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lock-base")
    cfg = tiny_config(root, train__checkpoint_every=10, train__sample_every=10**6)
    andrea("train", "--config", cfg, "--run-dir", str(root / "run"), "--max-steps", "10", "--device", "cpu")
    return root / "run"


def forged(base: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the run whose lock is another host's live-looking lease, with `fields` forged."""
    run = shutil.copytree(base, tmp_path / "A", symlinks=True)
    lock = json.loads((run / LOCK).read_text())
    lock.update({"released": False, "host": "elsewhere", "boot_id": "another-kernel", **fields})
    (run / LOCK).write_text(json.dumps(lock))
    return run


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"lease_ttl_s": 1e18}, "lease_ttl_s 1e+18 is outside 0..604800"),
        ({"lease_ttl_s": -5}, "lease_ttl_s -5 is outside"),
        ({"lease_ttl_s": "30"}, "lease_ttl_s: expected int/float or null, got str '30'"),
    ],
)
def test_gc_refuses_a_lock_with_an_unbounded_lease_at_once(base, tmp_path, fields, problem):
    run = forged(base, tmp_path, **fields)
    proc = andrea("gc", str(run), "--keep-last", "2", check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"andrea: error: {run / LOCK}: unreadable lock ({problem}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"started_at": "yesterday"}, "started_at: expected int/float, got str 'yesterday'"),
        ({"started_at": 1e300}, "started_at 1e+300 is outside"),
        ({"host": "evil\x1b]0;owned\x07\x1b[2J"}, "host 'evil\\x1b]0;owned\\x07\\x1b[2J': not printable"),
        ({"world_size": 10**9}, "world_size 1000000000 is outside 1..4096"),
        ({"pid": True}, "pid: expected int, got bool True"),
    ],
)
def test_status_reports_a_forged_lock_field_escaped_without_a_traceback(base, tmp_path, fields, problem):
    run = forged(base, tmp_path, **fields)
    proc = andrea("status", str(run), check=False, timeout=60)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "\x1b" not in out and "\x07" not in out, out
    assert problem in out, out
    with pytest.raises(Exception, match="unreadable lock"):
        read_lock(RunDir(str(run)))


# --- 4d: run files read whole are bounded --------------------------------------------------------


def sparse(path: Path, size: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def test_status_refuses_a_sparse_huge_lock_unread(base, tmp_path):
    run = shutil.copytree(base, tmp_path / "A", symlinks=True)
    sparse(run / LOCK, 2 << 30)
    proc = andrea("status", str(run), check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert f"{run / LOCK}: {2 << 30} bytes, more than the limit of" in out, out
    assert "Traceback" not in out


def test_export_never_copies_a_planted_huge_tokenizer(base, tmp_path):
    run = shutil.copytree(base, tmp_path / "A", symlinks=True)
    sparse(run / "tokenizer.json", 1 << 30)
    proc = andrea("export", str(run), str(tmp_path / "out"), check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run / 'tokenizer.json'}: {1 << 30} bytes, more than the limit of" in proc.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_every_lock_field_has_a_schema_entry():
    import dataclasses

    from andrea_core.run.lock import LOCK_SCHEMA, TrainerIdentity

    assert {f.name for f in dataclasses.fields(TrainerIdentity)} - {"run_dir"} == set(LOCK_SCHEMA)
