"""Audit-fork comparison (andrea_core.ops.compare): real branches (two replicates each) trained from one
checkpoint, scored on the same held-out batches at one step; the winner's margin and noise on known
numbers; a branch the divergence guard acted in, named and ranked apart (issue 41.4);
and the review's findings on fabricated runs (issues 15.8-17.7): no winner inside the noise, an
untrained branch shown as untrained, a branch that moves the held-out split refused, inputs escaped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from markdown_it import MarkdownIt
from test_retention import fabricated_run

from andrea_core.checkpoint import restore
from andrea_core.config import ConfigError
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import read_policy
from andrea_core.model.gpt import GPT
from andrea_core.ops.compare import (
    UNTRAINED,
    BranchResult,
    Comparison,
    _name_winner,
    compare_branches,
    comparison_figure,
    legend_label,
    plot_comparison,
    report_markdown,
    sequence_losses,
)
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.ops.loss_view import png_data_uri
from andrea_core.run.record import read_run
from andrea_core.run.rundir import LOSS_LOG, RunDir
from andrea_core.train.optim import build_optimizer
from andrea_core.untrusted import markdown_text
from tests.conftest import _env, andrea, library_run


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    parent = RunDir(library_run(tmp_path_factory, folder / "parent", 100))  # andrea-tiny at step 100
    branches = [BranchSpec("base"), BranchSpec("frozen", {"train.lr": 1e-9, "train.min_lr": 0.0})]
    urls = fork(parent.url, branches, 100, replicates=2)
    for url in urls:
        andrea("train", "--run-dir", url, "--max-steps", "160")
    return parent, [urls[0], urls[2]]  # replicate 0 of each: compare finds the others


def test_compare_names_the_branch_that_learns(forked):
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16)
    assert c.arms == ["stdlib-code"] and c.fork_step == 100
    base, frozen = c.branch("base"), c.branch("frozen")
    assert c.step == base.trained_to == frozen.trained_to == 160
    assert [r.url for r in base.runs] == [urls[0], urls[0] + ".r1"] and base.replicates == 2
    assert [e.step for e in base.history] == list(range(101, 161))
    assert c.winner == "base" and c.runner_up == "frozen" and c.significant
    assert c.margin == pytest.approx(frozen.val_mean - base.val_mean)
    assert base.val_mean == pytest.approx(np.mean(base.replicate_val)) and len(set(base.replicate_val)) == 2
    assert c.df == 2 and 0 < c.noise_training and 0 < c.noise_held_out and c.critical * c.noise < c.margin
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
    assert c.branch("base").runs[0].val_mean == float(sequence_losses(model, x, y).mean())
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
    assert "| **base** | (none) | 2: " in md and " | 160 | " in md
    assert "`train.lr=1e-09`" in md
    assert "](data:image/png;base64,iVBORw0KGgo" in md
    assert all(f"`{u}`" in md and f"`{u}.r1`" in md for u in urls)
    assert c.to_dict()["winner"] == "base" and "history" not in c.to_dict()["branches"][0]


def test_a_branch_that_failed_is_reported_not_ranked(forked):
    parent, urls = forked
    c = compare_branches(parent.url, urls, 100, val_sequences=16, failed={"base": "trainer exited 1"})
    # One branch left: nothing to compare it with, so no winner (issue 15.9), but it leads.
    assert c.winner is None and c.leader == "frozen" and c.runner_up is None and c.margin is None
    assert c.branch("base").problem == "trainer exited 1"
    assert "(trainer exited 1)" in report_markdown(c)


def test_a_branch_the_guard_acted_in_is_named_and_ranked_apart(forked, tmp_path):
    """A branch whose batch at data position 120 poisons its gradient: the divergence guard rolls it back
    to its fork point and trains it on at a cooled learning rate. It did not train under its overrides
    alone: the report, the JSON and the plot name its event and the settings after it, and it is
    ranked apart, never the winner, however low its loss (issue 41.4)."""
    parent, urls = forked
    spec = BranchSpec("poisoned", {"train.guard.rollback_margin": 10, "train.guard.in_branch": "remedy"})
    (poisoned,) = fork(parent.url, [spec], 100)
    env = {**_env(), "ANDREA_TEST_GUARD_NAN_AT": "120"}
    andrea("train", "--run-dir", poisoned, "--max-steps", "160", env=env)
    c = compare_branches(parent.url, [*urls, poisoned], 100, val_sequences=16)
    p = c.branch("poisoned")
    (event,) = p.guard_events
    assert (event["kind"], event["step"], event["rolled_back_to"]) == ("non-finite-grad-norm", 120, 100)
    assert (event["remedy_from"], event["skip"]) == (110, 10)  # 120 - rollback_margin: 101..110 retrained
    assert c.branch("base").guard_events == [] and p.trained_to == 160 and c.step == 160
    scale, cooldown = event["lr_scale"], event["cooldown"]
    assert 0 < scale < 1 and cooldown > 0
    # The remedy in the one wording of guard_events.remedy_clauses (the trainer's line, status, here).
    under = (
        f"steps 101..110 retrained on their own data, data positions 111..120 skipped, "
        f"lr x{scale:.3g} for steps 111..{110 + cooldown}"
    )
    said = f"diverged at step 120 (non-finite-grad-norm), rolled back to 100: {under}"
    assert p.diverged == said and c.to_dict()["branches"][2]["diverged"] == said
    # Ranked apart: the verdict is between base and frozen, and says why poisoned is not in it.
    assert c.leader == "base" and c.runner_up == "frozen" and c.winner == "base"
    assert c.verdict.endswith(
        f" (not ranked, the divergence guard changed how they trained: poisoned: {said})"
    )
    md = report_markdown(c).replace("\\", "")  # as rendered: the escapes of untrusted.markdown_text shown
    assert "| poisoned (diverged: ranked apart) |" in md
    assert (
        "Divergence guard in `poisoned` (ranked apart: it did not train under its overrides alone): "
        f"non-finite-grad-norm at step 120: rolled back to step 100: {under}"
    ) in md
    assert p.trained_under == [under] and f"It trained under: {under}." in md
    assert "Divergence guard in `base`" not in md
    legend = [t.get_text() for t in comparison_figure(c).axes[0].get_legend().get_texts()]
    assert legend == ["parent", "base (winner)", "frozen", "poisoned (diverged)"]
    others = compare_branches(parent.url, urls, 100, val_sequences=16)
    assert "The divergence guard acted in no branch." in report_markdown(others)


def test_a_branch_the_guard_stopped_is_named_diverged_and_leaves_the_others_common_step(forked):
    """A fork branch diverges and the guard stops it (train.guard.in_branch, default "stop": exit 3,
    issue 41.4). Compare names it diverged, with the step and the rule, and scores the others at their
    own common step (160): a stopped branch's last checkpoint does not hold them back (issue 42.3)."""
    parent, urls = forked
    spec = BranchSpec("stopped", {"train.guard.rollback_margin": 10})
    (stopped,) = fork(parent.url, [spec], 100)
    env = {**_env(), "ANDREA_TEST_GUARD_NAN_AT": "120"}
    proc = andrea("train", "--run-dir", stopped, "--max-steps", "160", env=env, check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "diverged at step 120 under train.guard.rollback_margin=10" in proc.stderr
    c = compare_branches(parent.url, [*urls, stopped], 100, val_sequences=16)
    s = c.branch("stopped")
    assert s.problem == "diverged at step 120 (non-finite-grad-norm): the guard stopped it"
    assert s.trained_to is None and s.val_mean is None and c.step == 160
    assert c.winner != "stopped" and c.leader != "stopped" and c.runner_up != "stopped"
    assert "| stopped (diverged at step 120 (non-finite-grad-norm)" in report_markdown(c).replace("\\", "")


# --- review findings (issues 15.8, 15.9, 15.10, 17.7): no winner inside the noise, no scoring on data a
# branch trained on, an untrained branch shown as untrained, and inputs escaped in the report.


SEQS = [1.0, 3.0, 1.5, 2.5, 2.0, 4.0]


def result(name: str, per_sequence: list[float], arm: str = "a") -> BranchResult:
    """Three replicates 0.01 either side of the branch's mean (training noise +-0.0082 a margin)."""
    values = np.asarray(per_sequence)
    mean = float(values.mean())
    return BranchResult(name, f"/runs/{name}", {}, val_loss={arm: mean}, val_mean=mean, replicates=3,
                        replicate_val=[mean - 0.01, mean, mean + 0.01], per_sequence=values)  # fmt: skip


def within_noise() -> Comparison:
    """The issue's numbers in miniature: a margin far inside the paired noise."""
    base = result("base", SEQS)
    other = result("other", [v + d for v, d in zip(SEQS, [0.2, -0.2, 0.1, -0.15, 0.05, 0.02], strict=True)])
    c = Comparison("/runs/p", 10, ["a"], 6, 64, [other, base])
    _name_winner(c)
    return c


def render(md: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(md)


def test_no_winner_inside_the_noise():
    c = within_noise()
    assert c.margin < 2 * c.noise
    assert c.winner is None and c.to_dict()["winner"] is None
    assert c.leader == "base" and c.runner_up == "other"
    assert c.verdict.startswith("no winner: within noise (base leads: held-out loss")
    md = report_markdown(c)
    assert "**No winner: within noise.** " + markdown_text("no winner: within noise") in md
    assert "Winner:" not in md and "**base**" not in md
    assert [legend_label(c, b) for b in c.branches] == ["other", "base"]
    assert plot_comparison(c)[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_winner_beyond_the_noise_is_named_in_headline_table_and_legend():
    better = result("better", SEQS)
    worse = result("worse", [v + d for v, d in zip(SEQS, [0.10, 0.12, 0.08, 0.11, 0.09, 0.10], strict=True)])
    c = Comparison("/runs/p", 10, ["a"], 6, 64, [worse, better])
    _name_winner(c)
    assert c.winner == c.leader == "better" and c.to_dict()["winner"] == "better"
    md = report_markdown(c)
    assert "**Winner: `better`**. better converges best" in md and "| **better** |" in md
    assert legend_label(c, better) == "better (winner)" and legend_label(c, worse) == "worse"


def test_a_single_evaluated_branch_is_not_a_winner():
    c = Comparison("/runs/p", 10, ["a"], 6, 64, [result("only", SEQS)])
    _name_winner(c)
    assert c.winner is None and c.leader == "only" and c.verdict.startswith("no winner: only is the only")


@pytest.fixture(scope="module")
def untrained_fork(tmp_path_factory):
    """A parent that logged 300 steps, forked at 200 into two branches that never trained."""
    folder = tmp_path_factory.mktemp("untrained")
    parent = fabricated_run(str(folder / "parent"), [100, 200, 300])
    lines = [
        json.dumps(
            {
                "step": s,
                "loss": 3.0 - s / 1000,
                "lr": 1e-3,
                "arm": "stdlib-code",
                "tokens": 512,
                "segment": 1,
                "time": 1.0,
            },
            separators=(",", ":"),
        )  # fmt: skip
        for s in range(1, 301)
    ]
    parent.write_text(LOSS_LOG, "\n".join(lines) + "\n")
    return parent, fork(parent.url, [BranchSpec("a"), BranchSpec("b", {"train.lr": 1e-3})], step=200)


def test_an_untrained_branch_is_reported_untrained_without_the_parents_losses(untrained_fork):
    parent, urls = untrained_fork
    c = compare_branches(parent.url, urls, 200, val_sequences=4)
    for b in c.branches:
        assert b.history == [] and b.final_loss is None and b.ema_loss is None
        assert b.problem == UNTRAINED and b.trained_to is None and b.runs[0].trained_to == 200
    assert c.winner is None and c.verdict.startswith("no branch could be evaluated: a: untrained")
    row = f"| a ({markdown_text(UNTRAINED)}) | (none) | 1 | n/a | n/a | n/a |"
    assert row in report_markdown(c)


def test_a_branch_that_changes_the_held_out_split_is_refused(untrained_fork, tmp_path):
    parent, _ = untrained_fork
    (moved,) = fork(parent.url, [BranchSpec("moved", {"data.val_fraction": 0.01})], step=200)
    (same,) = fork(parent.url, [BranchSpec("same")], step=100)
    with pytest.raises(
        ConfigError,
        match=r"branch 'moved': data\.val_fraction 0\.01 \(the parent's is 0\.05\)",
    ):
        compare_branches(parent.url, [same, moved], 200, val_sequences=4)


def test_inputs_are_escaped_in_the_report():
    """Branch, arm and policy names, URLs, overrides and error texts as an attacker would write them:
    rendered, the report holds no link, image or HTML element of theirs, and shows the text."""
    evil_arm = "[x](javascript:alert(1))"
    evil = result("<img src=x onerror=alert(1)>", SEQS, arm=evil_arm)
    evil.overrides = {"data.policy": "[p](javascript:alert(2))|<b>bold</b>"}
    evil.url = "/runs/`code`[y](javascript:alert(3))"
    other = result("![i](http://127.0.0.1/x.png)", [v + 0.1 for v in SEQS], arm=evil_arm)
    other.problem = "trainer failed: <script>alert(4)</script> [z](javascript:alert(5))"
    c = Comparison("/runs/<svg onload=alert(6)>`", 10, [evil_arm], 6, 64, [other, evil])
    _name_winner(c)
    html = render(report_markdown(c))
    assert "javascript:" not in "".join(html.split('href="')[1:]), "no link to javascript:"
    assert "<a " not in html and "<img" not in html and "<script" not in html and "<svg" not in html
    assert "<b>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "[x](javascript:alert(1))" in html
    assert "&lt;script&gt;alert(4)&lt;/script&gt;" in html
    # The table keeps its columns: a "|" inside a cell does not split it.
    rows = html.split("</table>")[0].split("<tr>")[2:]  # the branches' table, after its header row
    assert len(rows) == 2 and all(row.count("<td") == 9 for row in rows), rows


def test_the_trainer_status_artifact_escapes_its_inputs():
    from tasks.artifacts import status_markdown

    md = status_markdown(
        "trainer of <img src=x>",
        {"run": "/runs/[r](javascript:alert(1))", "summary": "failed | <script>x</script>", "step": 120},
    )
    html = render(md)
    assert "<a " not in html and "<img" not in html and "<script" not in html
    assert "| step | 120 |" in md and "&lt;img src=x&gt;" in html
    rows = html.split("<tr>")[2:]
    assert len(rows) == 3 and all(row.count("<td") == 2 for row in rows)
