"""Plots that explain themselves (issue 26.3): the loss view of a run that was resumed, pivoted and
forked, checked from the data it plots; the bias-corrected EMA; the fork report's error bars."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import andrea
from tiny import tiny_config

from andrea_core.ops.loss_view import Mark, draw_marks, envelope, loss_view, marks_to_label
from andrea_core.run.loss_log import ema_curve, read_history
from andrea_core.run.rundir import RunDir

OUT = Path(__file__).resolve().parents[1] / "test-output" / "loss-view"


def test_the_ema_is_bias_corrected_and_continues_from_a_start():
    losses = [5.5, 4.0, 3.5, 3.2, 3.0] + [2.9] * 20
    curve = ema_curve(losses, 0.05)
    for t in range(len(losses)):  # the weighted mean of the values so far, weights 0.05 * 0.95^age
        w = np.array([0.05 * 0.95 ** (t - i) for i in range(t + 1)])
        assert curve[t] == pytest.approx(float(w @ np.array(losses[: t + 1]) / w.sum()), rel=1e-12)
    assert curve[0] == 5.5
    # After 20 steps a curve started at the first value still carries 36% of it: 3.83 against 3.13.
    assert curve[19] < 3.2
    assert ema_curve([2.0, 2.0], start=3.0) == pytest.approx([2.95, 2.9025])


def test_a_long_curve_is_drawn_as_its_envelope_keeping_every_spike():
    """Weeks of steps are drawn as the lowest and highest point of each of PLOT_BUCKETS runs: at most
    twice that many points (and the two ends), in step order, and every point the curve reaches above or
    below a run's others drawn (a one-step spike and a one-step dip survive, where a mean would not)."""
    rng = np.random.default_rng(0)
    n = 600_000
    xs = list(range(1, n + 1))
    ys = list(3.0 + 0.1 * rng.standard_normal(n))
    ys[123_457], ys[400_001] = 40.0, -1.0  # a spike and a dip, one step each
    ex, ey = envelope(xs, ys, buckets=1000)
    assert len(ex) <= 2 * 1000 + 4 and ex == sorted(set(ex))
    assert (ex[0], ey[0], ex[-1], ey[-1]) == (1, ys[0], n, ys[-1])
    assert (123_458, 40.0) in zip(ex, ey, strict=True) and (400_002, -1.0) in zip(ex, ey, strict=True)
    assert all(ys[x - 1] == y for x, y in zip(ex, ey, strict=True))  # points of the curve, not made-up ones
    for b in range(1000):  # each run's extremes are drawn
        run = ys[b * n // 1000 : (b + 1) * n // 1000]
        assert min(run) in ey and max(run) in ey
    # A diverged stretch (NaN losses, a whole run of 600 steps and more): drawn as a gap, and the finite
    # points beside it in their runs still drawn.
    ys[200_000:201_500] = [float("nan")] * 1500
    ys[201_500] = 0.5
    ex, ey = envelope(xs, ys, buckets=1000)
    assert (201_501, 0.5) in zip(ex, ey, strict=True)
    gap = [y for x, y in zip(ex, ey, strict=True) if 200_000 < x <= 201_500]
    assert gap and all(math.isnan(y) for y in gap)
    short = list(range(50))
    assert envelope(short, [float(x) for x in short], buckets=1000) == (short, [float(x) for x in short])


@pytest.mark.slow
def test_a_plot_of_hundreds_of_marks_labels_the_rare_ones_and_counts_the_rest():
    """A run of weeks restarted 300 times: every mark is drawn, 24 are labelled (both pivots, the fork,
    then the newest resumes), and the legend counts the resumes left unlabelled."""
    marks = [Mark(s, "resume", f"resume from step {s}") for s in range(100, 30_100, 100)]
    marks += [Mark(5_000, "pivot", "pivot: p2"), Mark(20_000, "pivot", "pivot: p3")]
    marks += [Mark(25_000, "fork", "fork")]
    chosen = marks_to_label(marks)
    resumes = sorted(m.step for m in chosen if m.kind == "resume")
    assert len(chosen) == 24 and {m.kind for m in chosen if m.kind != "resume"} == {"pivot", "fork"}
    assert sum(m.kind == "pivot" for m in chosen) == 2 and resumes == list(range(28_000, 30_100, 100))
    assert marks_to_label(marks[:24]) == set(marks[:24])  # all of them, when they fit

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 30_000], [4.0, 2.0])
    draw_marks(ax, marks)
    ax.legend()
    labels = [t.get_text() for t in ax.texts]
    # The 24 labelled marks: both pivots and the fork alone, the 21 newest resumes as three counted
    # labels (each 7 within 2% of the plot's width: loss_view.group_text), not 21 overlapping ones.
    resumes = [f"7 x resume, steps {a}..{a + 600}" for a in (28_000, 28_700, 29_400)]
    assert sorted(labels) == sorted(["pivot: p2", "pivot: p3", "fork", *resumes])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["resume x300 (279 not labelled)"]
    drawn = sorted(int(seg[0][0]) for c in ax.collections for seg in c.get_segments())
    assert drawn == sorted(m.step for m in marks)  # every mark drawn
    assert ax.get_ylim()[0] > 1.5  # the lines span the axes without pulling the loss axis to 0
    plt.close(fig)


def test_the_loss_view_of_a_resumed_pivoted_and_forked_run(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", cfg, "--run-dir", str(run), "--max-steps", "20")
    andrea("train", "--run-dir", str(run), "--max-steps", "30")  # a resume from step 20
    andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")  # at step 30
    andrea("train", "--run-dir", str(run), "--max-steps", "40")
    andrea(
        "fork", str(run), "--step", "40", "--branch", "low-lr", "--set", "train.lr=1e-4", "--replicates", "1"
    )

    view = loss_view(str(run))
    assert view.marks == [
        Mark(20, "resume", "resume from step 20"),
        Mark(30, "pivot", "pivot to tiny-mix"),  # the pivot's own restart is not a second mark
        Mark(40, "fork", "fork: low-lr"),
    ]
    assert [e.step for e in view.history] == list(range(1, 41))
    assert view.ema == ema_curve([e.loss for e in read_history(RunDir(str(run)))])
    # Held-out loss points: every audit of both phases, per arm, as the files hold them.
    audits = json.loads((run / "archive/phase_001_step_000030/.samples.json").read_text())["audits"]
    audits += json.loads((run / ".samples.json").read_text())["audits"]
    want: dict[str, list] = {}
    for a in audits:
        for arm, loss in a["metrics"]["val_loss"].items():
            want.setdefault(arm, []).append((a["step"], loss))
    assert view.val == {arm: sorted(p) for arm, p in want.items()}
    assert [s for s, _ in view.val["stdlib-code"]] == [0, 10, 20, 30, 40]
    assert [s for s, _ in view.val["docs-prose"]] == [40]

    branch = loss_view(str(tmp_path / "run-fork40-low-lr"))
    assert branch.marks == [Mark(40, "forked-from", "forked from run at step 40")]

    OUT.mkdir(parents=True, exist_ok=True)
    png = tmp_path / "loss.png"
    out = andrea("loss", str(run), "--plot", str(png)).stdout
    assert f"plot written to {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shutil.copy(png, OUT / "resumed-pivoted-forked.png")  # looked at: see the closing note


def test_the_fork_reports_bars_carry_their_standard_errors():
    import matplotlib.pyplot as plt

    from andrea_core.ops.compare import BranchResult, Comparison, comparison_figure

    rng = np.random.default_rng(0)
    arms = ["code", "prose"]
    branches = []
    for name, shift in (("base", 0.0), ("low-lr", 0.01)):
        b = BranchResult(name, f"memory://{name}", {})
        per_arm = {arm: 3.0 + shift + 0.2 * rng.standard_normal(32) for arm in arms}
        b.val_loss = {arm: float(v.mean()) for arm, v in per_arm.items()}
        b.val_stderr = {arm: float(v.std(ddof=1) / np.sqrt(32)) for arm, v in per_arm.items()}
        branches.append(b)
    c = Comparison("memory://parent", 100, arms, 32, 64, branches, margin=0.01, noise=0.02)
    fig = comparison_figure(c)
    bx = fig.axes[1]
    bars = [k for k in bx.containers if hasattr(k, "errorbar") and k.errorbar is not None]
    assert len(bars) == 2
    for b, container in zip(branches, bars, strict=True):
        heights = [r.get_height() for r in container.patches]
        assert heights == pytest.approx([b.val_loss[a] for a in arms])
        (segments,) = container.errorbar.lines[2]  # the vertical error lines, one per bar
        spans = [seg[1][1] - seg[0][1] for seg in segments.get_segments()]
        assert spans == pytest.approx([2 * b.val_stderr[a] for a in arms])
    assert "paired margin 0.0100 vs noise ±0.0200" in bx.get_title()
    plt.close(fig)


def test_the_guards_rollbacks_and_stops_are_marked(tmp_path):
    from andrea_core.ops.loss_view import guard_marks
    from andrea_core.run.guard_events import KINDS, GuardEvent, append_event

    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    common = {"value": 9.0, "statistic": 3.0, "threshold": 6.0, "level": 0, "skip": 0, "time": 1.0}
    append_event(
        run,
        GuardEvent(1, "rollback", 57, 55, KINDS[0], rolled_back_to=50, lr_scale=0.5, cooldown=10, **common),
    )
    append_event(
        run, GuardEvent(2, "stop", 90, 88, KINDS[0], rolled_back_to=None, lr_scale=1.0, cooldown=0, **common)
    )
    assert guard_marks(run) == [
        Mark(57, "rollback", f"rollback to step 50 ({KINDS[0]})"),
        Mark(90, "guard-stop", f"guard stop ({KINDS[0]})"),
    ]
