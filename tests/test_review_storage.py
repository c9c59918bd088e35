"""Issue 14 (storage, retention, stop handling) and issue 18.2: each test reproduces a defect found in
review, against real trainers, a real run directory and the moto S3 server."""

from __future__ import annotations

import os
import signal

from conftest import andrea, last_logged_step

from andrea_core.audit import Auditor
from andrea_core.checkpoint import checkpoint_name, encode_header, step_from_name
from andrea_core.config import load_run_config
from andrea_core.retention import apply_retention
from andrea_core.rundir import RunDir
from andrea_core.trainer import Trainer
from tests.tiny import tiny_config


def tiny(tmp_path, **overrides):
    return load_run_config(tiny_config(tmp_path, **overrides))


# --- 14.8: one canonical name per step -------------------------------------------------------------


def test_canonical_names_only():
    assert step_from_name("step_000350.bin") == 350
    assert step_from_name("step_1234567.bin") == 1234567  # more digits only when the step needs them
    assert step_from_name("step_0000350.bin") is None
    assert step_from_name("step_0001234567.bin") is None


def test_a_non_canonical_checkpoint_name_is_ignored_with_a_warning_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", config, "--run-dir", str(run_dir), "--max-steps", "20")
    good = (run_dir / checkpoint_name(20)).read_bytes()
    stray = run_dir / "step_0000030.bin"  # 7 digits for step 30: not the name the trainer writes
    stray.write_bytes(encode_header(30, int.from_bytes(good[4:8], "little")) + good[8:])
    run = RunDir(str(run_dir))
    assert run.checkpoint_steps() == [10, 20]
    warnings: list[str] = []
    assert run.checkpoint_steps(warn=warnings.append) == [10, 20]
    assert warnings and "step_0000030.bin" in warnings[0] and "not a canonical checkpoint name" in warnings[0]

    proc = andrea("train", "--run-dir", str(run_dir), "--max-steps", "25", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resuming {run.url} from step_000020.bin" in proc.stdout
    assert "ignoring" in proc.stdout and "step_0000030.bin" in proc.stdout
    assert stray.read_bytes()[:4] == (30).to_bytes(4, "little")  # never moved, never deleted
    assert not (run_dir / "refused").exists()
    plan = apply_retention(run, tiny(tmp_path).retention, None, lambda m: None)
    assert 30 not in plan.delete and stray.exists()


# --- 14.5: a retention error is not a failed checkpoint --------------------------------------------


def test_a_retention_error_is_logged_as_such_and_retried_at_the_next_checkpoint(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, train__checkpoint_every=10, retention__keep_last=2, retention__keep_every=None)
    url = str(tmp_path / "run")
    denied: list[str] = []
    real_remove = RunDir.remove

    def remove(self, name):  # a delete the store denies, once (step 30's retention)
        if not denied:
            denied.append(name)
            raise PermissionError(13, "Permission denied", self.path(name))
        return real_remove(self, name)

    monkeypatch.setattr(RunDir, "remove", remove)
    logged: list[str] = []
    result = Trainer(url, cfg, max_steps=40, device="cpu", log=logged.append).train()
    text = "\n".join(logged)
    assert "NOT written" not in text, text
    assert result.reason == "completed" and result.checkpoint == checkpoint_name(40)
    assert denied == [checkpoint_name(10)]
    assert any(
        line.startswith("ERROR: retention after step_000030.bin failed: PermissionError") for line in logged
    ), text
    # Retried at step 40's checkpoint: the two newest stay, everything older is gone.
    assert RunDir(url).checkpoint_steps() == [30, 40]


# --- 14.4: a stop seen during an off-grid sample audit still checkpoints that step --------------------


def test_sigterm_during_an_off_grid_audit_checkpoints_that_step(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, train__checkpoint_every=20, train__sample_every=3)
    url = str(tmp_path / "run")
    real_record = Auditor.record

    def record(self, step):
        if step == 27:  # an audit off the checkpoint grid: the SIGTERM lands while it runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_record(self, step)

    monkeypatch.setattr(Auditor, "record", record)
    result = Trainer(url, cfg, max_steps=200, device="cpu", log=lambda m: None).train()
    run = RunDir(url)
    assert result.reason == "SIGTERM" and result.step == 27
    assert result.checkpoint == checkpoint_name(27)
    assert run.checkpoint_steps() == [20, 27] and run.read_checkpoint(27).step == 27
    assert last_logged_step(run) == 27  # nothing trained that the checkpoint does not hold
