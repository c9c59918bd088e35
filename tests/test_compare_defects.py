"""Audit-fork comparison defects (issues 15.8, 15.9, 15.10, 17.7): no winner inside the noise, no scoring
on data a branch trained on, an untrained branch shown as untrained, and inputs escaped in the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from markdown_it import MarkdownIt
from test_retention import fabricated_run

from andrea_core.config import ConfigError
from andrea_core.ops.compare import (
    UNTRAINED,
    BranchResult,
    Comparison,
    _name_winner,
    compare_branches,
    legend_label,
    plot_comparison,
    report_markdown,
)
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.run.rundir import LOSS_LOG
from andrea_core.untrusted import markdown_text

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
