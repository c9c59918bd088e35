"""A run's loss curve as the operator reads it: the training loss, its bias-corrected EMA, the held-out
(validation) loss of every sample audit per arm, and a labelled mark at each event that explains a bend:
a pivot (with the policy it installed), a resume (a new segment of .loss.json), a fork made from this
run, and the run's own fork point. `andrea loss --plot`, the Prefect dashboard and TensorBoard all draw
from `loss_view`, so every view shows the same data. Read from the run directory alone.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from andrea_core.config import ConfigError, load_yaml
from andrea_core.run.loss_log import LossEntry, ema_curve, read_history
from andrea_core.run.rundir import ARCHIVE, POLICY_YAML, SAMPLES, RunDir

EMA_ALPHA = 0.05


@dataclass(frozen=True)
class Mark:
    step: int
    kind: str  # "pivot", "resume", "fork", "forked-from" (and whatever a MARK_SOURCES entry adds)
    label: str


@dataclass
class LossView:
    run: str
    history: list[LossEntry]
    ema: list[float]
    val: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # arm -> (step, held-out loss)
    marks: list[Mark] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _policy_name(run: RunDir, name: str) -> str:
    try:
        doc = load_yaml(run.read_bounded(name).decode(errors="replace"), run.path(name))
        return str(doc.get("name") or "?") if isinstance(doc, dict) else "?"
    except (ConfigError, OSError, ValueError):
        return "?"


def _archives(run: RunDir) -> list[tuple[int, int, str]]:
    """(phase, boundary step, folder) of every closed phase, oldest first."""
    from andrea_core.run.lineage import PHASE_RE

    found = ((PHASE_RE.match(n), n) for n in run.listdir(ARCHIVE))
    return sorted((int(m.group(1)), int(m.group(2)), f"{ARCHIVE}/{n}") for m, n in found if m)


def pivot_marks(run: RunDir) -> list[Mark]:
    """A pivot at each closed phase's boundary, labelled with the policy the next phase trained on."""
    closed = _archives(run)
    marks = []
    for i, (_, boundary, _) in enumerate(closed):
        after = f"{closed[i + 1][2]}/{POLICY_YAML}" if i + 1 < len(closed) else POLICY_YAML
        marks.append(Mark(boundary, "pivot", f"pivot to {_policy_name(run, after)}"))
    return marks


def resume_marks(history: list[LossEntry], start: int) -> list[Mark]:
    """A resume where a segment starts past the run's first step: from the checkpoint one step before."""
    marks, segment = [], None
    for e in history:
        if e.segment != segment:
            segment = e.segment
            if e.step - 1 > start:
                marks.append(Mark(e.step - 1, "resume", f"resume from step {e.step - 1}"))
    return marks


def fork_marks(run: RunDir, warn: Callable[[str], None] | None = None) -> list[Mark]:
    from andrea_core.run.lineage import fork_records

    by_step: dict[int, list[str]] = {}
    for record in fork_records(run, warn):
        names = record.get("names") or [u.rstrip("/").rsplit("/", 1)[-1] for u in record["branches"]]
        by_step.setdefault(int(record["step"]), []).extend(names)
    return [Mark(s, "fork", f"fork: {', '.join(n)}") for s, n in sorted(by_step.items())]


def guard_marks(run: RunDir) -> list[Mark]:
    """The divergence guard's events (guard.jsonl): a rollback at the step that diverged, naming the
    checkpoint it went back to; a stop where the guard gave up."""
    from andrea_core.run.guard_events import read_events

    marks = []
    for e in read_events(run):
        if e.action == "rollback":
            marks.append(Mark(e.step, "rollback", f"rollback to step {e.rolled_back_to} ({e.kind})"))
        else:
            marks.append(Mark(e.step, "guard-stop", f"guard stop ({e.kind})"))
    return marks


# Further sources of marks (run -> marks): each is called on every view, and what it returns is drawn
# like the others (labelled, by kind).
MARK_SOURCES: list[Callable[[RunDir], list[Mark]]] = [guard_marks]


def loss_view(url: str | RunDir, history: list[LossEntry] | None = None) -> LossView:
    """The view of the run at `url`; `history`: its canonical loss history if the caller read it."""
    from andrea_core.run.record import read_run
    from andrea_core.run.samples import read_audits

    run = url if isinstance(url, RunDir) else RunDir(url)
    history = read_history(run) if history is None else history
    view = LossView(run.url, history, ema_curve([e.loss for e in history], EMA_ALPHA))

    # Held-out loss per arm from every audit: the closed phases' (archived at their pivots) and this one's.
    for name in [f"{folder}/{SAMPLES}" for _, _, folder in _archives(run)] + [SAMPLES]:
        try:
            audits = read_audits(run, name)
        except ConfigError as e:
            view.problems.append(str(e))
            continue
        for audit in audits:
            for arm, loss in ((audit.get("metrics") or {}).get("val_loss") or {}).items():
                if isinstance(loss, int | float) and math.isfinite(loss):
                    view.val.setdefault(arm, []).append((audit["step"], float(loss)))
    for points in view.val.values():
        points.sort()

    start = 0
    if run.exists("run.yaml"):
        lineage = read_run(run).lineage
        if lineage.get("parent"):
            start = int(lineage.get("parent_step") or 0)
            parent = str(lineage["parent"]).rstrip("/").rsplit("/", 1)[-1]
            view.marks.append(Mark(start, "forked-from", f"forked from {parent} at step {start}"))
    pivots = pivot_marks(run)
    at_pivot = {m.step for m in pivots}
    view.marks += pivots
    # A pivot restarts the trainer at its boundary: that resume is the pivot's, labelled once.
    view.marks += [m for m in resume_marks(history, start) if m.step not in at_pivot]
    view.marks += fork_marks(run, view.problems.append)
    for source in MARK_SOURCES:
        view.marks += source(run)
    view.marks.sort(key=lambda m: (m.step, m.kind))
    return view


# A line of more points than this is drawn as its envelope (envelope()): a plot is 900 pixels wide, and
# weeks of steps (600,000 of them: 2.4 s to draw whole, under load) would otherwise cost every dashboard.
PLOT_BUCKETS = 2000


def envelope(xs: list[int], ys: list[float], buckets: int = PLOT_BUCKETS) -> tuple[list[int], list[float]]:
    """At most 2 * `buckets` + 4 points that draw as `ys` does at plot resolution: the lowest and the highest
    point of each of `buckets` runs of consecutive points, in step order (a spike a mean would hide is
    kept; the first and last points are always in)."""
    import numpy as np

    n = len(xs)
    if n <= 2 * buckets:
        return list(xs), list(ys)
    values = np.asarray(ys, dtype=np.float64)
    out: list[int] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        chunk = values[lo:hi]
        if np.isnan(chunk).all():  # a diverged stretch: drawn as the gap it is
            i_min = i_max = lo
        else:
            i_min, i_max = lo + int(np.nanargmin(chunk)), lo + int(np.nanargmax(chunk))
        out += sorted({lo, i_min, i_max, hi - 1} if b in (0, buckets - 1) else {i_min, i_max})
    return [xs[i] for i in out], [ys[i] for i in out]


# At most this many marks are labelled on a plot (900 pixels wide): a run of weeks restarted hundreds of
# times has hundreds of resumes, whose labels would overlap into a grey band and take seconds to draw.
PLOT_LABELS = 24


def marks_to_label(marks: list[Mark], most: int = PLOT_LABELS) -> set[Mark]:
    """The marks a plot labels: all of them when they fit, else the rarer kinds first (pivots, forks,
    then resumes), each kind's newest first; the others are drawn, and counted in the legend."""
    if len(marks) <= most:
        return set(marks)
    by_kind: dict[str, list[Mark]] = {}
    for m in marks:
        by_kind.setdefault(m.kind, []).append(m)
    chosen: list[Mark] = []
    for kind in sorted(by_kind, key=lambda k: (len(by_kind[k]), k)):
        chosen += sorted(by_kind[kind], key=lambda m: -m.step)[: most - len(chosen)]
    return set(chosen)


# Greys and line styles for the marks (their labels say what each is); the arms' points take the colours.
MARK_STYLE = {
    "pivot": ("0.1", "-"),
    "resume": ("0.5", ":"),
    "fork": ("0.3", "--"),
    "forked-from": ("0.3", "-."),
    "rollback": ("tab:red", "--"),
    "guard-stop": ("tab:red", "-"),
}

# Labels closer than this share of the plot's width are drawn as one (rotated text is about 1.5% wide
# at 7 points on 900 pixels): a fork and the two rollbacks right after it read as one list, not a blot.
LABEL_GAP = 0.02


def label_groups(marks: list[Mark], span: float, gap: float = LABEL_GAP) -> list[tuple[int, list[Mark]]]:
    """The labelled marks in step order, those closer than `gap` x `span` steps to the first of their
    group joined: (the group's step, its marks)."""
    groups: list[tuple[int, list[Mark]]] = []
    for m in sorted(marks, key=lambda m: (m.step, m.kind)):
        if groups and m.step - groups[-1][0] <= gap * span:
            groups[-1][1].append(m)
        else:
            groups.append((m.step, [m]))
    return groups


def group_text(step: int, group: list[Mark]) -> str:
    """One label for a group of close marks: each mark's own while there are at most three, else each
    kind counted with its first and last step, so the label stays short however many marks fall there."""
    if len(group) <= 3:
        return "; ".join(m.label if m.step == step else f"{m.step}: {m.label}" for m in group)
    parts = []
    for kind in dict.fromkeys(m.kind for m in group):
        same = [m for m in group if m.kind == kind]
        parts.append(
            same[0].label
            if len(same) == 1
            else f"{len(same)} x {kind}, steps {same[0].step}..{same[-1].step}"
        )
    return "; ".join(parts)


def draw_marks(ax: Any, marks: list[Mark]) -> None:
    """The marks on a plot's axes: a vertical line each (one line collection a kind) and the labels of
    marks_to_label; a kind with unlabelled marks is counted in the legend."""
    labelled = marks_to_label(marks)
    for kind in dict.fromkeys(m.kind for m in marks):  # one line collection a kind, in mark order
        color, style = MARK_STYLE.get(kind, ("0.3", "-."))
        steps = [m.step for m in marks if m.kind == kind]
        unnamed = sum(1 for m in marks if m.kind == kind and m not in labelled)
        ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), colors=color, linestyles=style, lw=1,
                  label=f"{kind} x{len(steps)} ({unnamed} not labelled)" if unnamed else None)  # fmt: skip
    low, high = ax.get_xlim()
    for step, group in label_groups(list(labelled), max(high - low, 1.0)):
        color = MARK_STYLE.get(group[0].kind, ("0.3", "-."))[0]
        text = group_text(step, group)
        ax.annotate(
            text.replace("$", r"\$"),
            (step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -4),
            textcoords="offset points",
            rotation=90,
            va="top",
            fontsize=7,
            color=color,
            bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
        )


def png_data_uri(png: bytes) -> str:
    """A PNG as a data URI: a plot embedded in a markdown artifact, which the UI shows without access to
    the run's storage."""
    return "data:image/png;base64," + base64.b64encode(png).decode()


def plot_view(view: LossView, title: str | None = None) -> bytes:
    """PNG of the view: raw training loss (faint), its EMA, held-out loss points per arm, labelled marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
    steps = [e.step for e in view.history]
    ax.plot(
        *envelope(steps, [e.loss for e in view.history], PLOT_BUCKETS),
        lw=0.7,
        alpha=0.35,
        color="C0",
        label="training loss",
    )
    ax.plot(
        *envelope(steps, view.ema, PLOT_BUCKETS),
        lw=1.6,
        color="C0",
        label=f"training loss EMA ({EMA_ALPHA:g}, bias-corrected)",
    )
    markers = "osD^vP*X"
    for i, (arm, points) in enumerate(sorted(view.val.items())):
        ax.plot(
            [s for s, _ in points],
            [v for _, v in points],
            ls="none",
            marker=markers[i % len(markers)],
            ms=5,
            color=f"C{i + 1}",
            label=f"held-out loss: {arm}".replace("$", r"\$"),
        )
    draw_marks(ax, view.marks)
    ax.set(xlabel="step", ylabel="loss", title=(title if title is not None else view.run).replace("$", r"\$"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")  # a falling curve leaves that corner empty; marks label the top
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
