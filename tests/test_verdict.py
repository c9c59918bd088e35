"""The audit fork's verdict (issue 42): its test on known numbers, pinned either side of its cut-off;
the noise's parts in the verdict, the report and the JSON; one step for every branch (or a refusal
naming the branch that falls short); and, item 15 of issue 43, a forged branch name."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import ConfigError
from andrea_core.ops.compare import (
    LEVEL,
    NOISE_RESOLUTION,
    BranchResult,
    Comparison,
    _name_winner,
    compare_branches,
    markdown_text,
    plot_comparison,
    report_markdown,
    t_critical,
)
from andrea_core.ops.fork import BranchSpec, fork, replicate_seed
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir

SEQS = np.array([1.0, 3.0, 1.5, 2.5, 2.0, 4.0, 2.2, 1.8])


def branch(name: str, replicate_val: list[float], spread: list[float] | None = None) -> BranchResult:
    """A branch whose runs scored `replicate_val`; its replicate-mean per-sequence losses are SEQS
    moved to that mean, plus `spread` (the held-out sampling noise of a paired difference)."""
    mean = float(np.mean(replicate_val))
    per_sequence = SEQS - SEQS.mean() + mean + (np.asarray(spread) if spread is not None else 0.0)
    return BranchResult(name, f"/runs/{name}", {}, val_loss={"a": mean}, val_mean=mean,
                        replicates=len(replicate_val), replicate_val=list(replicate_val),
                        per_sequence=per_sequence)  # fmt: skip


def test_the_critical_values_are_students_t():
    """Two-sided 5% points of Student's t, from the printed tables."""
    assert LEVEL == 0.05
    for df, table in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423), (200, 1.9719)):
        assert t_critical(df) == pytest.approx(table, abs=2e-4), df


@pytest.mark.parametrize("factor, wins", [(1.02, True), (0.98, False)])
def test_the_cut_off_is_the_t_critical_value_times_the_noise(factor, wins):
    """Two branches of 3 replicates (training: 4 degrees of freedom) scored on 8 held-out sequences
    (held-out: 7), the two parts of the noise equal; the t is the training part's, t(0.975, 4) =
    2.7764 (Welch-Satterthwaite's 10.18 would give 2.2228). A margin 2% either side of 2.7764 x the
    noise: moving LEVEL, the t quantile, a part of the noise or the degrees of freedom moves one of
    these two cases across."""
    d = 0.01
    training = d * math.sqrt(2 / 3)  # pooled variance d^2 (each branch: +-d around its mean), 1/3 + 1/3
    pattern = np.array([1.0, -1.0] * 4)
    held_out = pattern * training * math.sqrt(8) / pattern.std(ddof=1)  # its standard error = training
    noise = training * math.sqrt(2)
    margin = factor * 2.7764 * noise
    a = branch("a", [2.0 - d, 2.0, 2.0 + d])
    b = branch("b", [2.0 + margin - d, 2.0 + margin, 2.0 + margin + d], spread=held_out)
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a])
    _name_winner(c)
    assert (c.leader, c.runner_up, c.df, c.df_held_out) == ("a", "b", 4, 7)
    assert c.margin == pytest.approx(margin, rel=1e-9)
    assert c.noise_training == pytest.approx(training, rel=1e-9)
    assert c.noise_held_out == pytest.approx(training, rel=1e-9)
    assert c.noise == pytest.approx(noise, rel=1e-9)
    assert c.df_effective == 4 and c.critical == pytest.approx(2.7764, abs=1e-4)
    assert c.significant is wins and (c.winner == "a") is wins
    if wins:
        assert c.verdict.startswith("a converges best: held-out loss ") and c.to_decide is None
        assert f"{factor * 2.7764:.1f} standard errors, a winner needs 2.78" in c.verdict
    else:
        assert c.verdict.startswith("no winner: within noise (a leads: ")
        # What would decide it, with numbers: the lead this noise needs; the replicates that would.
        assert c.to_decide.startswith(f"a lead of {c.critical * noise:.4f} would be decisive at this noise; ")
        assert "at this lead and spread, 4 replicates a branch would decide it" in c.to_decide


def test_without_held_out_noise_the_test_is_the_two_sample_t_test():
    """Identical held-out differences on every sequence: only the training part, 4 degrees of freedom."""
    d = 0.01
    noise = d * math.sqrt(2 / 3)
    for factor, wins in ((1.02, True), (0.98, False)):
        margin = factor * 2.7764 * noise
        a, b = (
            branch("a", [2.0 - d, 2.0, 2.0 + d]),
            branch("b", [2.0 + margin - d, 2.0 + margin, 2.0 + margin + d]),
        )
        c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a])
        _name_winner(c)
        assert c.noise_held_out == pytest.approx(0, abs=1e-12) and c.df_effective == pytest.approx(4)
        assert c.critical == pytest.approx(2.7764, abs=1e-4) and (c.winner == "a") is wins


def test_one_run_a_branch_names_no_winner_however_large_the_lead():
    """Today's rule named a winner at 2 held-out standard errors; one run a branch measures nothing of
    the training noise, so the verdict names none and says what would decide it."""
    a, b = branch("a", [2.0]), branch("b", [2.5], spread=[0.01, -0.01] * 4)
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a])
    _name_winner(c)
    assert c.winner is None and c.leader == "a" and c.df == 0 and c.noise_training is None
    assert c.margin / c.noise > 100
    assert c.verdict.startswith("no winner: training noise unmeasured (a leads: ")
    assert c.to_decide.startswith("fork again with --replicates 3")
    md = report_markdown(c)
    assert "**No winner: training noise unmeasured.**" in md
    assert "| training (data order: the replicates' spread, 0 degrees of freedom) | unmeasured" in md


def test_the_json_and_the_report_carry_the_noise_parts_and_the_test():
    a = branch("a", [2.00, 2.01, 1.99])
    b = branch("b", [2.30, 2.31, 2.29], spread=[0.01, -0.01] * 4)
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a], step=140)
    _name_winner(c)
    out = c.to_dict()
    assert out["winner"] == "a" and out["step"] == 140 and out["df"] == 4 and out["level"] == 0.05
    assert out["noise_training"] == pytest.approx(0.01 * math.sqrt(2 / 3))
    both = math.hypot(out["noise_training"], out["noise_held_out"])
    assert out["noise_held_out"] > 0 and out["noise"] == pytest.approx(both)
    assert out["df_held_out"] == 7 and out["df_effective"] == 4
    assert out["critical"] == pytest.approx(t_critical(out["df_effective"]))
    assert out["test"].startswith("two-sample t-test")
    assert [x["replicate_val"] for x in out["branches"]] == [[2.30, 2.31, 2.29], [2.00, 2.01, 1.99]]
    assert [x["replicates"] for x in out["branches"]] == [3, 3]
    md = report_markdown(c)
    assert "Every column is of step 140: the newest step past the fork" in md
    assert f"leader vs runner-up) | {c.noise_held_out:.4f} |" in md
    assert (
        f"| training (data order: the replicates' spread, 4 degrees of freedom) | {c.noise_training:.4f} |"
        in md
    )
    assert "| 3: 2.0000, 2.0100, 1.9900 |" in md
    assert (
        "a winner when the margin exceeds 2.78x the noise (Student's t, 4 degrees of freedom, the training "
        "part's; the held-out part's 7 are not counted)"
    ) in md


@pytest.mark.parametrize("factor, measured", [(1.05, True), (0.95, False)])
def test_a_noise_below_the_resolution_of_the_losses_is_none(factor, measured):
    """A noise of factor x NOISE_RESOLUTION (1e-6 nats), the lead 0.05: just above it the t-test
    judges (a winner, the ratio printed); just below it there is no noise to weigh the lead against
    and the verdict says so, not "inf standard errors" nor a winner for a lead of any size."""
    assert NOISE_RESOLUTION == 1e-6
    d = factor * NOISE_RESOLUTION / math.sqrt(2 / 3)  # the replicates' spread; held-out: none
    a = branch("a", [2.0 - d, 2.0, 2.0 + d])
    b = branch("b", [2.05 - d, 2.05, 2.05 + d])
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a], step=120)
    _name_winner(c)
    assert c.noise == pytest.approx(factor * NOISE_RESOLUTION, rel=1e-6)
    assert "inf" not in c.verdict and json.dumps(c.to_dict(), allow_nan=False)
    if measured:
        assert c.winner == "a" and c.verdict.startswith("a converges best: held-out loss 2.0000 vs 2.0500")
        assert f"{0.05 / c.noise:.1f} standard errors, a winner needs 2.78" in c.verdict
        return
    assert c.winner is None and c.significant is False and c.leader == "a"
    assert c.verdict == (
        "no winner: no noise measured (a leads: held-out loss 2.0000 vs 2.0500 for b at step 120; margin "
        "0.0500; the replicates of each branch scored the same, 3+3 of them, and the lead is the same on "
        "every one of the 8 held-out sequences, so the test has nothing to weigh it against); replicates "
        "that score the same did not train on different data orders: check each replicate's train.seed, "
        "and fork again with replicates whose data orders differ"
    )
    md = report_markdown(c)
    assert f"**No winner: no noise measured.** {markdown_text(c.verdict)}\n" in md
    assert f"What would decide it: {markdown_text(c.to_decide)}.\n" in md


def test_branches_that_scored_the_same_are_said_to_be_the_same(tmp_path):
    """A real compare of branches whose every run holds the fork point's weights (no noise, no lead):
    once "0.0 standard errors ... a lead of 0.0000 would be decisive at this noise"."""
    parent, urls = _fake_fork(tmp_path, {"a": [120], "b": [120]}, replicates=2)
    c = compare_branches(parent.url, [urls[0], urls[2]], 100, val_sequences=4)
    assert c.noise == 0 and c.margin == 0 and c.df == 2 and c.winner is None
    mean = c.branches[0].val_mean
    assert c.verdict == (
        f"no winner: {c.leader} and {c.runner_up} scored the same (held-out loss {mean:.4f} at step 120, on "
        "every held-out sequence and in every replicate): nothing tells them apart; if they should "
        "differ, check the branches' overrides; replicates that score the same did not train on "
        "different data orders (check each replicate's train.seed)"
    )
    assert json.loads(json.dumps(c.to_dict(), allow_nan=False))["noise"] == 0


def test_one_run_a_branch_with_no_held_out_noise_prints_no_ratio():
    a, b = branch("a", [2.0]), branch("b", [2.5])
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a], step=120)
    _name_winner(c)
    assert c.winner is None and c.noise < NOISE_RESOLUTION
    assert c.verdict.startswith(
        "no winner: training noise unmeasured (a leads: held-out loss 2.0000 vs 2.5000 for b at step 120; "
        "margin 0.5000, the same lead on every one of the 8 held-out sequences, but one run a branch"
    )


def test_held_out_sequences_are_scored_in_chunks_of_bounded_logits(monkeypatch):
    """The default held-out set (256 an arm) at once would hold 256 x block x vocab logits (24 GiB at
    andrea-120m): scored in chunks of LOGITS_AT_ONCE, each sequence's loss is its own forward's."""
    import torch
    import torch.nn.functional as F

    from andrea_core.model.gpt import GPT
    from andrea_core.model_config import ModelConfig
    from andrea_core.ops import compare

    assert compare.DEFAULT_VAL_SEQUENCES == 256 and compare.LOGITS_AT_ONCE == 1 << 28
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda xi, *a: calls.append(len(xi)) or forward(xi, *a))
    monkeypatch.setattr(compare, "LOGITS_AT_ONCE", 3 * 16 * 64 + 5)  # 3 sequences' logits at once
    got = compare.sequence_losses(model, x, y)
    assert calls == [3, 3, 2] and got.shape == (8,) and got.dtype == np.float64
    with torch.no_grad():
        each = [F.cross_entropy(forward(x[i : i + 1])[0][0], y[i]).item() for i in range(8)]
    assert got == pytest.approx(each, rel=1e-6)


FORGED = r"$\sqrt{\frac{a}{b}}\undefinedcommand$"


def test_a_name_that_is_mathtext_is_plotted_as_text():
    """Issue 43.15: the held-out bars' legend took the branch name raw, and matplotlib's mathtext
    raised on it (no report at all)."""
    a = branch(FORGED, [2.0, 2.01])
    b = branch("b", [2.3, 2.31])
    c = Comparison("/runs/p", 10, ["a"], SEQS.size, 64, [b, a])
    _name_winner(c)
    assert plot_comparison(c)[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_fork(tmp_path, steps: dict[str, list[int]], replicates: int = 1) -> tuple[RunDir, list[str]]:
    """A fabricated parent (all-zero weights) forked at 100 into branches a and b (b at lr 1e-3), each
    then holding checkpoints at `steps[name]` (written, not trained: the fork point's weights)."""
    from test_retention import fabricated_run

    parent = fabricated_run(str(tmp_path / "parent"), [100])
    urls = fork(
        parent.url, [BranchSpec("a"), BranchSpec("b", {"train.lr": 1e-3})], 100, replicates=replicates
    )
    flat = parent.read_checkpoint(100).flat
    for url in urls:
        name = read_run(RunDir(url)).lineage["branch"]
        for step in steps[name]:
            RunDir(url).write_atomic(checkpoint_name(step), encode(step, flat))
    return parent, urls


def test_branches_of_unequal_length_are_scored_at_their_newest_common_step(tmp_path):
    parent, urls = _fake_fork(tmp_path, {"a": [120, 140], "b": [120, 140, 160, 180]})
    c = compare_branches(parent.url, urls, 100, val_sequences=4)
    assert c.step == 140 and [b.trained_to for b in c.branches] == [140, 140]
    assert [r.trained_to for b in c.branches for r in b.runs] == [140, 180]
    md = report_markdown(c)
    assert (
        "Every column is of step 140" in md
        and "Trained to (newest checkpoint of each run): a 140, b 180." in md
    )


def test_branches_with_no_common_step_are_refused_naming_the_one_that_falls_short(tmp_path):
    parent, urls = _fake_fork(tmp_path, {"a": [150], "b": [200]})
    with pytest.raises(ConfigError) as e:
        compare_branches(parent.url, urls, 100, val_sequences=4)
    assert str(e.value) == (
        "compare: no step past the fork point 100 has a valid checkpoint in every branch (a holds [150]; "
        f"b holds [200]); a falls short of step 200: run andrea train --run-dir {urls[0]} --max-steps 200"
    )


def test_a_torn_common_checkpoint_moves_every_branch_to_the_previous_common_step(tmp_path):
    parent, urls = _fake_fork(tmp_path, {"a": [120, 140], "b": [120, 140]}, replicates=2)
    RunDir(urls[3]).write_atomic(checkpoint_name(140), b"torn")  # b's replicate 1
    warned = []
    c = compare_branches(parent.url, urls, 100, val_sequences=4, warn=warned.append)
    assert c.step == 120 and all(r.val_mean is not None for b in c.branches for r in b.runs)
    assert any("scoring every branch at an earlier common step" in w for w in warned)


def test_a_fork_with_replicates(tmp_path):
    """Replicate r of every branch shares one data order (seed + r x 1,000,003); replicate 0 is the
    branch as a fork without replicates makes it; compare finds the replicates beside replicate 0."""
    parent, urls = _fake_fork(tmp_path, {"a": [120], "b": [120]}, replicates=3)
    base = f"{parent.url}-fork100"
    assert urls == [f"{base}-a", f"{base}-a.r1", f"{base}-a.r2", f"{base}-b", f"{base}-b.r1", f"{base}-b.r2"]
    seeds = [read_run(RunDir(u)).config.train.seed for u in urls]
    assert seeds == [1337, 1337 + 1_000_003, 1337 + 2_000_006] * 2
    assert replicate_seed(1337, 2) == 1337 + 2_000_006
    lineage = read_run(RunDir(urls[4])).lineage
    assert (lineage["branch"], lineage["replicate"], lineage["replicates"]) == ("b", 1, 3)
    assert lineage["overrides"] == {"train.lr": 1e-3}
    c = compare_branches(parent.url, [urls[0], urls[3]], 100, val_sequences=4)  # replicate 0s only
    assert [[r.url for r in b.runs] for b in c.branches] == [urls[:3], urls[3:]]
    assert c.df == 4 and c.step == 120
    shutil.rmtree(urls[5])
    with pytest.raises(
        ConfigError, match=r"branch 'b': replicate 2 of 3 is missing \(.*-b\.r2\): rerun the fork"
    ):
        compare_branches(parent.url, [urls[0], urls[3]], 100, val_sequences=4)


def test_a_forged_branch_name_in_run_yaml_is_refused_naming_the_field(tmp_path):
    """Issue 43.15: lineage.branch is read as a fork writes it: a name no fork could have made."""
    parent, urls = _fake_fork(tmp_path, {"a": [120], "b": [120]})
    run = RunDir(urls[1])
    text = run.read_text("run.yaml").replace("branch: b", "branch: '" + FORGED.replace("'", "''") + "'")
    run.write_text("run.yaml", text)
    with pytest.raises(ConfigError, match=r"run\.yaml: lineage\.branch: name .* is not allowed"):
        compare_branches(parent.url, urls, 100, val_sequences=4)
