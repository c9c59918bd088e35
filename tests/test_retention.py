"""Checkpoint retention: keep_last, keep_every, protected pivot boundaries and fork points."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY, andrea

from andrea_core import cli
from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import RetentionConfig, load_run_config
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.ops.pivot import pivot_run_directory
from andrea_core.run.record import read_run, run_n_params
from andrea_core.run.retention import apply_retention, plan_retention
from andrea_core.run.rundir import RunDir
from andrea_core.train.setup import create_run
from andrea_core.train.trainer import Trainer
from tests.tiny import tiny_config

CFG = RetentionConfig(keep_last=3, keep_every=500)
GRID = list(range(100, 2001, 100))


def test_plan_keeps_the_newest_the_grid_and_the_protected():
    protected = {300: ["fork point (a)"], 1100: ["pivot boundary (phase 1)"]}
    plan = plan_retention(GRID, CFG, protected, newest=2000)
    assert sorted(plan.keep) == [300, 500, 1000, 1100, 1500, 1800, 1900, 2000]
    assert plan.delete == [100, 200, 400, 600, 700, 800, 900, 1200, 1300, 1400, 1600, 1700]
    assert plan.keep[2000] == ["one of the newest 3", "multiple of keep_every 500"]
    assert plan.keep[300] == ["fork point (a)"]
    assert plan.keep[1100] == ["pivot boundary (phase 1)"]


def test_plan_never_deletes_at_or_above_the_newest_valid_checkpoint():
    plan = plan_retention(GRID, CFG, {}, newest=1800)  # 1900 and 2000 failed validation
    assert sorted(plan.keep) == [500, 1000, 1500, 1600, 1700, 1800, 1900, 2000]
    assert plan.keep[2000] == [
        "multiple of keep_every 500",
        "newer than the newest valid checkpoint (kept as evidence)",
    ]
    assert plan_retention(GRID, RetentionConfig(keep_last=None), {}, newest=2000).delete == []


def test_keep_last_below_two_is_refused():
    cfg = load_run_config(TINY)
    with pytest.raises(Exception, match="retention.keep_last must be >= 2"):
        cfg.with_overrides({"retention.keep_last": 1}, "test")


def fabricated_run(url: str, steps: list[int]) -> RunDir:
    """A run directory with valid (all-zero) checkpoints at `steps`, written without training."""
    run = RunDir(url)
    record = create_run(run, load_run_config(TINY))
    n = run_n_params(record)
    for step in steps:
        run.write_atomic(checkpoint_name(step), encode(step, np.zeros(3 * n, dtype=np.float32)))
    return run


def test_nothing_is_deleted_until_the_newest_checkpoint_reads_back_valid(tmp_path):
    run = fabricated_run(str(tmp_path / "run"), [100, 200, 300, 400, 500, 600])
    n = run_n_params(read_run(run))
    run.write_atomic(checkpoint_name(600), b"torn")  # e.g. a store that lost part of the upload
    logged = []
    plan = apply_retention(run, CFG, n, logged.append, newest=600)  # the trainer's call
    assert plan.deleted == [] and run.checkpoint_steps() == [100, 200, 300, 400, 500, 600]
    assert "retention deletes nothing: the newest checkpoint does not read back valid" in logged[0]

    plan = apply_retention(run, CFG, n, logged.append)  # `andrea gc`: finds the newest valid, 500
    assert plan.newest == 500 and plan.deleted == [100, 200]
    assert run.checkpoint_steps() == [300, 400, 500, 600]  # 600 stays: evidence, never deleted here


def test_gc_dry_run_shows_and_gc_does(tmp_path, capsys):
    url = str(tmp_path / "run")
    run = fabricated_run(url, [100, 200, 300, 400, 500, 600, 700])
    fork(url, [BranchSpec("a")], step=200)
    record = read_run(run)
    run.write_text("run.yaml", record.to_yaml().replace("keep_last: 5", "keep_last: 2"))
    assert cli.main(["gc", url, "--dry-run"]) == 0
    assert capsys.readouterr().out == (
        f"{url}:\n"
        "  step_000100.bin  would delete\n"
        "  step_000200.bin  keep          fork point (a)\n"
        "  step_000300.bin  would delete\n"
        "  step_000400.bin  would delete\n"
        "  step_000500.bin  would delete\n"
        "  step_000600.bin  keep          one of the newest 2\n"
        "  step_000700.bin  keep          one of the newest 2\n"
        "3 kept, 4 would delete\n"
    )
    assert run.checkpoint_steps() == [100, 200, 300, 400, 500, 600, 700]
    assert cli.main(["gc", url, "--keep-every", "250"]) == 0
    out = capsys.readouterr().out
    assert "  step_000500.bin  keep          multiple of keep_every 250\n" in out
    assert out.endswith("4 kept, 3 deleted\n")
    assert run.checkpoint_steps() == [200, 500, 600, 700]
    held = run.read_json(".trainer.json")  # gc held the lock only while it worked: left released
    assert held["released"] is True


# The guard's reach on a grid of checkpoints every 10 as it is on a real run's every 100 (7 steps, not 69:
# retention keeps every checkpoint within the reach, which is test_guard_rules' and test_guard_continuity's).
SCALED_GUARD = {"rollback_margin": 5, "rise_steps": 0}


def retention_config(tmp_path: Path) -> str:
    """andrea-tiny, narrower and shorter-context, on a grid 10x finer than a real run's: checkpoint_every
    10, keep_last 3, keep_every 50 (the plan of checkpoint_every 100, keep_every 500 in a tenth of the
    steps), and the guard's reach scaled with them: rollback_margin 5, no rise rule, so the rollback
    point is 5 + 3 - 1 = 7 steps back (69 on the real grid: under one interval, as there)."""
    doc = yaml.safe_load(Path(TINY).read_text())
    doc["model"].update(n_layer=1, n_embd=32, block_size=32)
    doc["train"].update(batch_size=4, log_every=50, checkpoint_every=10)
    doc["train"]["guard"] = {**doc["train"].get("guard", {}), **SCALED_GUARD}
    doc["retention"] = {"keep_last": 3, "keep_every": 50}
    path = tmp_path / "retention.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.slow
def test_retention_over_a_run_with_a_pivot_and_a_fork_on_s3(s3_bucket, tmp_path):
    parent, config = f"{s3_bucket}/run", retention_config(tmp_path)

    def train(url: str, to: int, *extra: str) -> None:
        andrea("train", *extra, "--run-dir", url, "--max-steps", str(to), "--device", "cpu", timeout=900)

    train(parent, 40, "--config", config)
    assert RunDir(parent).checkpoint_steps() == [20, 30, 40]
    (branch,) = fork(parent, [BranchSpec("a")], step=30)
    train(parent, 110)
    assert RunDir(parent).checkpoint_steps() == [30, 50, 90, 100, 110]
    pivot_run_directory(RunDir(parent), 110, (Path(TINY).parent / "policies" / "default.yaml").read_text())
    train(parent, 200)
    train(branch, 80)

    def files(url: str) -> set[str]:
        """The run's files, TensorBoard's event files by segment (their names hold wall-clock times)."""
        run = RunDir(url)
        names = {p.removeprefix(run.root + "/") for p in run.fs.find(run.root)}
        return {re.sub(r"^tensorboard/events\.out\.tfevents\.\d+\.", "tensorboard/", n) for n in names}

    sidecars = {".samples.json", ".state.json"}  # written once the bandit and audit exist
    expected_parent = {
        "run.yaml",
        "policy.yaml",
        ".loss.json",
        "forks.jsonl",
        "archive/phase_001_step_000110/policy.yaml",
        "archive/phase_001_step_000110/phase.json",
        ".trainer.json",  # left released at each clean exit (its generation kept)
        "data.jsonl",  # the arms each trainer start loaded
        "target.jsonl",  # the step each trainer start was asked to reach
        "segments.jsonl",  # each segment's conditions and resume check (run/resume_check.py)
        # one TensorBoard segment per trainer start: never pruned, like .loss.json
        *(f"tensorboard/andrea.segment{n:04d}" for n in (1, 2, 3)),
    } | {checkpoint_name(s) for s in (30, 50, 100, 110, 150, 180, 190, 200)}
    assert (
        files(parent) - sidecars - {f"archive/phase_001_step_000110/{s}" for s in sidecars} == expected_parent
    )
    expected_branch = {
        *("run.yaml", "policy.yaml", ".loss.json", ".trainer.json", "data.jsonl", "target.jsonl"),
        "segments.jsonl",
        "tensorboard/andrea.segment0002",  # numbered by its .loss.json, whose segment 1 is the parent's
    } | {
        checkpoint_name(s)
        for s in (30, 50, 60, 70, 80)  # 30: where the branch was forked
    }
    assert files(branch) - sidecars == expected_branch

    dry = andrea("gc", parent, "--dry-run").stdout
    assert "  step_000030.bin  keep          fork point (a)\n" in dry
    assert "  step_000110.bin  keep          pivot boundary (phase 1)\n" in dry
    assert dry.endswith("8 kept, 0 would delete\n")
    lineage = andrea("lineage", parent).stdout
    assert lineage == (
        f"{parent}  newest checkpoint step_000200.bin\n"
        "├── phase 1  steps 0..110  policy stdlib-only  [archive/phase_001_step_000110]\n"
        "│   └── fork at step 30: a\n"
        f"│       └── {branch}  newest checkpoint step_000080.bin\n"
        "│           └── phase 1  steps 30..80 (current)  policy stdlib-only\n"
        "└── phase 2  steps 110..200 (current)  policy default\n"
    )


# --- issue 14.5 (review): a retention error is not a failed checkpoint --------------------------------------


def test_a_retention_error_is_logged_as_such_and_retried_at_the_next_checkpoint(tmp_path, monkeypatch):
    cfg = load_run_config(
        tiny_config(
            tmp_path,
            train__checkpoint_every=10,
            retention__keep_last=2,
            retention__keep_every=None,
            **{f"train__guard__{k}": v for k, v in SCALED_GUARD.items()},
        )
    )
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
