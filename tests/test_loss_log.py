"""`.loss.json`: append-only JSON Lines, segments per start, canonical history, torn last lines."""

from __future__ import annotations

import json

from conftest import TINY, andrea

from andrea_core.run.loss_log import LossWriter, canonical, parse_lines, read_history
from andrea_core.run.rundir import LOSS_LOG, RunDir


def _line(step, loss, segment):
    return json.dumps(
        {"step": step, "loss": loss, "lr": 0.1, "arm": "a", "tokens": 1, "segment": segment, "time": 0}
    )


def test_canonical_history_takes_the_newest_segment_and_drops_abandoned_tails():
    lines = [_line(s, float(s), 1) for s in range(1, 8)]  # segment 1 ran to step 7, crashed
    lines += [_line(s, s + 0.5, 2) for s in range(6, 10)]  # resumed from checkpoint 5
    lines += [_line(s, s + 0.25, 3) for s in range(9, 11)]  # resumed from checkpoint 8
    history = canonical(parse_lines("\n".join(lines).encode())[0])
    assert [(e.step, e.loss, e.segment) for e in history] == [
        (1, 1.0, 1), (2, 2.0, 1), (3, 3.0, 1), (4, 4.0, 1), (5, 5.0, 1),
        (6, 6.5, 2), (7, 7.5, 2), (8, 8.5, 2), (9, 9.25, 3), (10, 10.25, 3),
    ]  # fmt: skip


def newest_segments_by_definition(entries):
    """The canonical history as its definition reads (and loss_log computed it before 2026-12-05): a
    dict of every step, cut at each segment's first step. Quadratic in the segments (bench/dashboard.py
    measures it as the baseline)."""
    history, segment = {}, None
    for e in entries:
        if e.segment != segment:
            segment, history = e.segment, {s: v for s, v in history.items() if s < e.step}
        history[e.step] = e
    return [history[s] for s in sorted(history)]


def test_the_canonical_history_of_many_segments_is_the_per_step_newest_segments():
    """newest_segments against its definition (a dict of every step, cut at each segment's start) on
    random logs of many segments: resumes below, at and above the newest step, steps logged twice or out
    of order within a segment, a segment number met before (a forged log). Its cost, linear where the
    definition is quadratic in the segments, is bench/dashboard.py's."""
    import random

    from andrea_core.run.loss_log import LossEntry, newest_segments

    def entry(step, segment, i):
        return LossEntry(step, float(i), 0.1, None, 1, segment, float(i))

    rng = random.Random(3)
    for _ in range(300):
        entries, step, i = [], 0, 0
        for k in range(1, rng.randint(1, 12) + 1):
            segment = k if rng.random() < 0.8 else rng.randint(1, k)  # a number met before: forged
            step = max(0, step + rng.randint(-40, 5))
            for _ in range(rng.randint(0, 60)):
                step = step + 1 if rng.random() < 0.85 else max(0, step - rng.randint(0, 20))
                i += 1
                entries.append(entry(step, segment, i))
        assert newest_segments(entries) == newest_segments_by_definition(entries)


def test_torn_last_line_is_skipped_and_the_next_segment_starts_on_a_new_line(tmp_path):
    run = RunDir(str(tmp_path))
    (tmp_path / LOSS_LOG).write_bytes((_line(1, 1.0, 1) + "\n" + _line(2, 2.0, 1))[:-7].encode())
    assert [e.step for e in read_history(run)] == [1]

    writer = LossWriter(run)
    assert writer.segment == 2
    writer.log(2, 2.5, 0.1, "a", 1, 0.0)
    writer.close()
    raw = (tmp_path / LOSS_LOG).read_bytes()
    entries, skipped = parse_lines(raw)
    assert skipped == 1 and [(e["step"], e["segment"]) for e in entries] == [(1, 1), (2, 2)]
    assert [(e.step, e.loss) for e in read_history(run)] == [(1, 1.0), (2, 2.5)]


def test_loss_log_is_only_appended_to_across_restarts(tmp_path):
    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "30")
    first = (run / LOSS_LOG).read_bytes()
    andrea("train", "--run-dir", str(run), "--max-steps", "60")
    second = (run / LOSS_LOG).read_bytes()
    assert second.startswith(first) and len(second) > len(first)
    history = read_history(RunDir(str(run)))
    assert [e.step for e in history] == list(range(1, 61))
    assert {e.segment for e in history} == {1, 2} and all(e.arm == "stdlib-code" for e in history)


def test_andrea_loss_prints_summary_and_writes_a_png(tmp_path):
    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "40")
    plot = tmp_path / "loss.png"
    proc = andrea("loss", str(run), "--plot", str(plot))
    last = read_history(RunDir(str(run)))[-1]
    assert f"step 40  loss {last.loss:.4f}" in proc.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(andrea("loss", str(run), "--json").stdout)
    assert summary["last_step"] == 40 and summary["steps"] == 40
