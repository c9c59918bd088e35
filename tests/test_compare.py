"""Audit-fork comparison (andrea_core.ops.compare): real branches trained from one checkpoint, scored on the
same held-out batches; and the winner's margin and noise on known numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from andrea_core.checkpoint import restore
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import read_policy
from andrea_core.model.gpt import GPT
from andrea_core.ops.compare import (
    BranchResult,
    Comparison,
    _name_winner,
    compare_branches,
    plot_comparison,
    png_data_uri,
    report_markdown,
    sequence_losses,
)
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir
from andrea_core.train.optim import build_optimizer
from tests.conftest import _env, andrea
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    parent = RunDir(folder / "parent")
    andrea("train", "--config", tiny_config(folder), "--run-dir", parent.url, "--max-steps", "100")
    branches = [BranchSpec("base"), BranchSpec("frozen", {"train.lr": 1e-9, "train.min_lr": 0.0})]
    urls = fork(parent.url, branches, 100)
    for url in urls:
        andrea("train", "--run-dir", url, "--max-steps", "160")
    return parent, urls


def test_compare_names_the_branch_that_learns(forked):
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16)
    assert c.arms == ["stdlib-code"] and c.fork_step == 100
    base, frozen = c.branch("base"), c.branch("frozen")
    assert base.trained_to == frozen.trained_to == 160
    assert [e.step for e in base.history] == list(range(101, 161))
    assert c.winner == "base" and c.runner_up == "frozen" and c.significant
    assert c.margin == pytest.approx(frozen.val_mean - base.val_mean)
    assert 0 < c.noise < c.margin / 2
    assert c.verdict.startswith("base converges best")
    assert frozen.overrides == {"train.lr": 1e-9, "train.min_lr": 0.0}


def test_held_out_loss_is_the_checkpoints_own(forked):
    """The score of a branch is its newest checkpoint's loss on the arm's fixed validation batch,
    recomputed here from scratch."""
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16)
    branch = RunDir(urls[0])
    cfg = read_run(branch).config
    model = GPT(cfg.model)
    restore(branch.read_checkpoint(160), model, build_optimizer(model, cfg.train, "cpu"))
    model.eval()
    x, y = DataPipeline(cfg, read_policy(branch)).val_batch("stdlib-code", 16)
    with torch.no_grad():
        _, loss = model(x, y)
    # Bit for bit on the CPU: the same weights, batch and reduction give the same float.
    assert c.branch("base").val_loss["stdlib-code"] == float(sequence_losses(model, x, y).mean())
    # The per-sequence losses average to the model's own loss (another reduction order: to rounding).
    assert sequence_losses(model, x, y).mean() == pytest.approx(loss.item(), rel=1e-6)


def test_report_and_plot(forked):
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16)
    png = plot_comparison(c)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = report_markdown(c, png_data_uri(png))
    assert md.startswith(f"# Audit fork of `{parent.url}` at step 100")
    assert "**Winner: `base`**" in md
    assert "| **base** | (none) | 160 |" in md
    assert "`train.lr=1e-09`" in md
    assert "](data:image/png;base64,iVBORw0KGgo" in md
    assert all(f"`{u}`" in md for u in urls)
    assert c.to_dict()["winner"] == "base" and "history" not in c.to_dict()["branches"][0]


def test_a_branch_that_failed_is_reported_not_ranked(forked):
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16, failed={"base": "trainer exited 1"})
    # One branch left: nothing to compare it with, so no winner (issue 15.9), but it leads.
    assert c.winner is None and c.leader == "frozen" and c.runner_up is None and c.margin is None
    assert c.branch("base").problem == "trainer exited 1"
    assert "(trainer exited 1)" in report_markdown(c)


def _result(name: str, per_sequence: list[float]) -> BranchResult:
    values = np.asarray(per_sequence)
    return BranchResult(name, name, {}, val_loss={"a": float(values.mean())}, val_mean=float(values.mean()),
                        per_sequence=values)  # fmt: skip


def test_margin_and_noise_are_paired():
    """Sequences differ in difficulty far more than the branches do; pairing cancels that spread."""
    hard_and_easy = [1.0, 3.0, 1.5, 2.5, 2.0, 4.0]
    better = _result("better", hard_and_easy)
    worse = _result(
        "worse", [v + d for v, d in zip(hard_and_easy, [0.10, 0.12, 0.08, 0.11, 0.09, 0.10], strict=True)]
    )
    c = Comparison("p", 10, ["a"], 6, 64, [worse, better])
    _name_winner(c)
    diffs = np.array([0.10, 0.12, 0.08, 0.11, 0.09, 0.10])
    assert c.winner == "better" and c.runner_up == "worse"
    assert c.margin == pytest.approx(diffs.mean())
    assert c.noise == pytest.approx(diffs.std(ddof=1) / math.sqrt(6))
    assert c.significant  # unpaired, the spread of 1.0..4.0 would have drowned a 0.1 lead

    tie = _result(
        "tie", [v + d for v, d in zip(hard_and_easy, [0.2, -0.2, 0.1, -0.15, 0.05, 0.02], strict=True)]
    )
    c = Comparison("p", 10, ["a"], 6, 64, [tie, better])
    _name_winner(c)
    assert c.winner is None and c.leader == "better" and not c.significant
    assert c.verdict.startswith("no winner: within noise")


def test_the_report_says_which_branch_rolled_back(forked, tmp_path):
    """A branch whose batch at data position 120 poisons its gradient: the divergence guard rolls it back
    to its fork point; the report says so (issue 27), and that the others did not."""
    parent, urls = forked
    (poisoned,) = fork(parent.url, [BranchSpec("poisoned", {"train.guard.rollback_margin": 10})], 100)
    env = {**_env(), "ANDREA_TEST_GUARD_NAN_AT": "120"}
    andrea("train", "--run-dir", poisoned, "--max-steps", "160", env=env)
    c = compare_branches(parent.url, [*urls, poisoned], 100, val_sequences=16)
    (event,) = c.branch("poisoned").guard_events
    assert (event["kind"], event["step"], event["rolled_back_to"]) == ("non-finite-grad-norm", 120, 100)
    assert c.branch("base").guard_events == [] and c.branch("poisoned").trained_to == 160
    md = report_markdown(c)
    assert "Branch `poisoned` rolled back (divergence guard): non-finite-grad-norm at step 120, " in md
    assert "rolled back to 100." in md and "Branch `base`" not in md
    others = compare_branches(parent.url, urls, 100, val_sequences=16)
    assert "No branch rolled back (divergence guard)." in report_markdown(others)
