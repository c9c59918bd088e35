"""Benchmark: the run's dashboard (ops/dashboard.py, published at every checkpoint by the Prefect train
flow) of a run weeks long, against the same page made as before 2026-12-04 (the loss history read twice,
once by the status and once by the view, and every step drawn), in the same run.

The run is real (an andrea-tiny run of one step, its run.yaml, policy and checkpoint) with a loss log
of `--steps` steps written in the trainer's own line format, in `--segments` segments (one a trainer
start: a run of weeks restarted by crashes, pivots and the divergence guard has hundreds), each
resumed 100 steps below the last one's end. Both pages are made `--repeats` times, alternating; medians
are printed. "Before" also takes the canonical history as it was before 2026-12-05 (a dict of every
step copied at each segment: quadratic in the segments) and draws every mark with its label. So is
`andrea status` (ops/status.run_status) of the same run, reading the log's end (loss_log.read_recent)
against the whole canonical history it read before 2026-12-05 (asserted to say the same step and speed).

    .venv/bin/python bench/dashboard.py [--steps 600000] [--segments 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def make_run(folder: Path, steps: int, segments: int) -> str:
    from tiny import tiny_config

    run = folder / "run"
    cfg = tiny_config(folder)
    env = {**os.environ, "ANDREA_CACHE_DIR": str(folder / "cache")}
    argv = [sys.executable, "-m", "andrea_core", "train", "--config", cfg, "--run-dir", str(run)]
    subprocess.run([*argv, "--max-steps", "1"], check=True, capture_output=True, env=env, cwd=REPO)
    rng, t0 = random.Random(0), time.time() - steps * 0.05
    per = steps // segments
    with open(run / ".loss.json", "w") as f:
        for segment in range(1, segments + 1):
            first = max(1, (segment - 1) * per - 100)  # resumed from a checkpoint 100 steps back
            for s in range(first, steps + 1 if segment == segments else segment * per + 1):
                line = {"step": s, "loss": 5 * (s + 10) ** -0.1 + 0.1 * rng.random(), "lr": 3e-4}
                line |= {"arm": "stdlib-code", "tokens": 512, "segment": segment, "time": t0 + s * 0.05}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return str(run)


def every_mark_labelled(ax, marks) -> None:
    """The marks as plot_view drew them before 2026-12-05: a line and a label each."""
    from andrea_core.ops.loss_view import MARK_STYLE

    for m in marks:
        color, style = MARK_STYLE.get(m.kind, ("0.3", "-."))
        ax.axvline(m.step, color=color, ls=style, lw=1)
        box = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}
        ax.annotate(m.label, (m.step, 1), xycoords=("data", "axes fraction"), xytext=(3, -4), fontsize=7,
                    textcoords="offset points", rotation=90, va="top", color=color, bbox=box)  # fmt: skip


def before(url: str) -> str:
    """The page as it was made before: status and view each read the history; every point drawn."""
    from test_loss_log import newest_segments_by_definition  # the old canonical history

    from andrea_core.ops import dashboard, loss_view, status
    from andrea_core.run import loss_log
    from andrea_core.run.loss_log import read_history

    real = (
        dashboard.read_history,
        loss_view.PLOT_BUCKETS,
        status.read_recent,
        loss_log.newest_segments,
        loss_view.draw_marks,
    )
    dashboard.read_history = lambda run: None  # run_status and loss_view then read it themselves
    status.read_recent = lambda run, window_s: read_history(run)  # the whole of it, as before
    loss_view.PLOT_BUCKETS = 10**12
    loss_log.newest_segments = newest_segments_by_definition
    loss_view.draw_marks = every_mark_labelled
    try:
        return dashboard.dashboard(url)[0]
    finally:
        (
            dashboard.read_history,
            loss_view.PLOT_BUCKETS,
            status.read_recent,
            loss_log.newest_segments,
            loss_view.draw_marks,
        ) = real


def now(url: str) -> str:
    from andrea_core.ops import dashboard

    return dashboard.dashboard(url)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600_000)
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="andrea-bench-dashboard-") as tmp:
        os.environ["ANDREA_CACHE_DIR"] = str(Path(tmp) / "cache")
        url = make_run(Path(tmp), args.steps, args.segments)
        size = (Path(url) / ".loss.json").stat().st_size
        now(url)  # imports and matplotlib's first figure, outside the timings
        times: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(args.repeats):
            for name, make in (("before", before), ("now", now)):
                t0 = time.perf_counter()
                make(url)
                times[name].append(time.perf_counter() - t0)
        b, n = statistics.median(times["before"]), statistics.median(times["now"])
        mb = size / 1e6
        print(
            f"dashboard of a run of {args.steps:,} steps in {args.segments} segments "
            f"(.loss.json {mb:.1f} MB), median of {args.repeats}:"
        )
        print(f"  before (history read twice, every step and mark label drawn, quadratic history): {b:.2f} s")
        print(f"  now (one read, the curve's envelope drawn):     {n:.2f} s   ({n / b:.2f}x)")
        whole, tail = status_times(url, args.repeats)
        print(f"andrea status of the same run, median of {args.repeats}:")
        print(f"  before (the whole log parsed):                  {whole:.3f} s")
        print(f"  now (the log's end: its last minute of logging): {tail:.3f} s   ({tail / whole:.3f}x)")


def status_times(url: str, repeats: int) -> tuple[float, float]:
    from andrea_core.ops.status import run_status
    from andrea_core.run.loss_log import read_history
    from andrea_core.run.rundir import RunDir

    times: dict[str, list[float]] = {"whole": [], "tail": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = run_status(url, history=read_history(RunDir(url)))
        t1 = time.perf_counter()
        b = run_status(url)
        times["whole"].append(t1 - t0)
        times["tail"].append(time.perf_counter() - t1)
        assert (a.step, a.steps_per_s, a.tokens_per_s) == (b.step, b.steps_per_s, b.tokens_per_s)
    return statistics.median(times["whole"]), statistics.median(times["tail"])


if __name__ == "__main__":
    main()
