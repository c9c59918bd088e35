"""`.loss.json` (contract): the run's append-only audit trail, as JSON Lines.

One object per line: {"step", "loss", "lr", "arm", "tokens", "segment", "time", "elapsed"} and, where the
trainer measured it, "grad_norm" (the global gradient norm before clipping; the divergence guard reads it
back). "time" is the trainer's wall clock (for people: it follows a clock step); "elapsed" the seconds
since its segment opened on its awake clock (poll.awake_clock: a clock step does not move it), which
speeds are measured on. Lines written before "elapsed" was logged lack it.
Never rewritten, truncated, archived or moved. Each trainer start (and each rollback of the divergence
guard) opens a new segment; after a resume from step S the steps above S are logged again under it.
The canonical history is, for each step, the entry of the newest segment, with an abandoned timeline's
tail (steps past a later resume point) dropped.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import orjson

from andrea_core.config import check_limit, limit
from andrea_core.poll import awake_clock
from andrea_core.run.rundir import LOSS_LOG, RunDir


class LossEntry(NamedTuple):
    step: int
    loss: float
    lr: float
    arm: str | None
    tokens: int
    segment: int
    time: float
    grad_norm: float = math.nan  # absent from lines written before it was logged
    elapsed: float = math.nan  # seconds since the segment opened, on the awake clock; absent: likewise


# A malformed line of any kind (torn by a crash, junk, nested past the parser's recursion limit) is
# skipped and counted, never raised: one bad line must not break every reader of an append-only file.
JSON_LINE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError)


@contextlib.contextmanager
def _collector_paused():
    """Hundreds of thousands of new objects and no reference cycles: a cyclic collection on every few
    hundred allocations would only rescan them (a third of the reading time, measured)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def json_lines(data: bytes) -> tuple[list[tuple[int, Any]], list[int]]:
    """(line number, value) of each line that json.loads parses, and the numbers of those that do not
    (from 1; blank lines are neither). The plain reader, for small files and short tails."""
    parsed, bad = [], []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            parsed.append((number, json.loads(line)))
        except (ValueError, RecursionError):
            bad.append(number)
    return parsed, bad


def well_formed_lines(
    data: bytes,
    parse: Callable[[Any], Any],
    where: str,
    warn: Callable[[str], None] | None = None,
) -> list[Any]:
    """`parse(value)` of every line of a small JSON Lines run file (forks.jsonl, data.jsonl,
    guard.jsonl, target.jsonl), in file order. A line that is not JSON, or that `parse` rejects (it
    returns None or raises one of JSON_LINE_ERRORS), is skipped and reported once through `warn`:
    a torn or forged line never stops a resume, a status or a fork."""
    parsed, bad = json_lines(data)
    out = []
    for number, value in parsed:
        try:
            item = parse(value)
        except JSON_LINE_ERRORS:
            item = None
        (bad.append(number) if item is None else out.append(item))
    if bad and warn is not None:
        warn(f"{where}: skipped {len(bad)} malformed line(s): lines {', '.join(map(str, sorted(bad)))}")
    return out


def _entry(obj: dict) -> LossEntry:
    """An entry from a parsed line; ValueError, KeyError or TypeError if it is not one."""
    return LossEntry(
        int(obj["step"]),
        float(obj["loss"]),
        float(obj.get("lr", math.nan)),
        obj.get("arm"),
        int(obj.get("tokens", 0)),
        int(obj["segment"]),
        float(obj.get("time", 0.0)),
        float(obj.get("grad_norm", math.nan)),
        float(obj.get("elapsed", math.nan)),
    )


def parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Parsed entries in file order, and how many lines were skipped as torn or malformed."""
    parsed, bad = json_lines(data)
    entries, skipped = [], len(bad)
    for _, obj in parsed:
        try:
            int(obj["step"]), float(obj["loss"]), int(obj["segment"])
        except JSON_LINE_ERRORS:
            skipped += 1  # a crash mid-append leaves a torn line; it never breaks a reader
            continue
        entries.append(obj)
    return entries, skipped


def parse_entries(data: bytes) -> tuple[list[LossEntry], int]:
    """`parse_lines` as LossEntry values, and fast: orjson, one loop, `_entry` inlined (measured in
    bench/loss_log.py). orjson refuses NaN and Infinity (LossWriter writes them for a diverged step)
    and a few texts json.loads takes: those lines go to json.loads, so the result is json.loads'."""
    entries: list[LossEntry] = []
    append, loads, orjson_error, nan = entries.append, orjson.loads, orjson.JSONDecodeError, math.nan
    skipped = 0
    with _collector_paused():
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                try:
                    obj = loads(line)
                except orjson_error:
                    obj = json.loads(line)
                step, segment, tokens = obj["step"], obj["segment"], obj.get("tokens", 0)
                if type(step) is float or type(segment) is float or type(tokens) is float:
                    # orjson reads an integer past 64 bits as a float; json.loads keeps it whole.
                    obj = json.loads(line)
                    step, segment, tokens = obj["step"], obj["segment"], obj.get("tokens", 0)
                loss, lr, arm, t = obj["loss"], obj.get("lr", nan), obj.get("arm"), obj.get("time", 0.0)
                g, e = float(obj.get("grad_norm", nan)), float(obj.get("elapsed", nan))
                entry = (int(step), float(loss), float(lr), arm, int(tokens), int(segment), float(t), g, e)
                append(LossEntry(*entry))
            except JSON_LINE_ERRORS:
                skipped += 1  # a crash mid-append leaves a torn line; it never breaks a reader
    return entries, skipped


def newest_segments(entries: Iterable[LossEntry]) -> list[LossEntry]:
    """The history the run actually has: for each step, the newest segment's entry (file order in).

    A segment starts right after its resume point, so whatever the older timelines logged from its
    first step on was lost with them: an entry stands if no later segment starts at or below its step
    and no later line logs its step again. Read from the end, that is one pass and a dict, whatever the
    number of segments (a run of weeks has one a restart; copying the dict of every step at each of them
    made a read quadratic) and whatever order a forged log's steps come in."""
    segments: list[list[LossEntry]] = []  # runs of consecutive lines of one segment, in file order
    for e in entries:
        if not segments or e.segment != segments[-1][-1].segment:
            segments.append([])
        segments[-1].append(e)
    history: dict[int, LossEntry] = {}
    below: float = math.inf  # the lowest first step of the segments after this one
    for lines in reversed(segments):
        for e in reversed(lines):
            if e.step < below and e.step not in history:
                history[e.step] = e
        below = min(below, lines[0].step)
    return [history[s] for s in sorted(history)]


def canonical(entries: list[dict]) -> list[LossEntry]:
    """The canonical history of `parse_lines`' entries."""
    return newest_segments(map(_entry, entries))


def read_history(run: RunDir) -> list[LossEntry]:
    try:  # read, not exists() then read: on an object store that is a request less
        data = run.read_bounded(LOSS_LOG, "ANDREA_MAX_LOSS_LOG_BYTES")
    except FileNotFoundError:
        return []
    return newest_segments(parse_entries(data)[0])


def recent_window(entries: list[LossEntry], window_s: float) -> tuple[list[LossEntry], bool]:
    """The newest segment's entries of its last `window_s` seconds of logging, at the end of `entries`
    (a canonical history, or a log's lines in file order), and whether an entry before them is outside
    the window (an older segment's, or older than it): False when they may reach further back. Walked
    from the end, at the cost of the window, not of a history of millions of steps. The times are the
    trainer's wall clock: the window also ends at a time later than the next one's (the clock stepped
    back), whose entries before it are of another timeline (they would count their steps twice). Where
    the newest entry has "elapsed", the window is measured on it instead (a clock step forward would
    hold a gap of the step's size): back to an entry without it, or with a later one than the next's."""
    if not entries:
        return [], False
    last = entries[-1]
    clock = (lambda e: e.elapsed) if math.isfinite(last.elapsed) else (lambda e: e.time)
    since, i, later = clock(last) - window_s, len(entries) - 1, clock(last)
    while i >= 0 and entries[i].segment == last.segment and since <= clock(entries[i]) <= later:
        later = clock(entries[i])
        i -= 1
    return entries[i + 1 :], i >= 0


def read_recent(run: RunDir, window_s: float, chunk: int = 1 << 18) -> list[LossEntry]:
    """The newest segment's entries of its last `window_s` seconds of logging (its newest step and its
    speed: what `andrea status` shows), read from the end of the log: a chunk, doubled until it reaches
    back past the window, to an older segment or to the file's start. The same entries as the
    canonical history's (read_history) of the newest segment in that window, at the cost of the window,
    not of a log of millions of steps."""
    most = limit("ANDREA_MAX_LOSS_LOG_BYTES")
    while True:
        try:  # read, not exists() then read: on an object store that is a request less
            data, start = run.read_tail(LOSS_LOG, min(chunk, most))
        except FileNotFoundError:
            return []
        if start:
            # Its first line is cut (with no line end at all, the chunk is one cut line: parsed as torn).
            data = data[data.find(b"\n") + 1 :]
        window, whole = recent_window(parse_entries(data)[0], window_s)
        if whole or not start:
            return window
        if chunk >= most:  # not even the bound reaches back far enough (a whole read refuses it too)
            what = f"{run.path(LOSS_LOG)}: the last {window_s:g}s of its newest segment take"
            check_limit(most + 1, "ANDREA_MAX_LOSS_LOG_BYTES", what)
        chunk *= 2


def ema_curve(values: list[float], alpha: float = 0.05, start: float | None = None) -> list[float]:
    """The exponential moving average after each value (the smoothed curve of a plot), bias-corrected
    as Adam's moments are: the average starts at 0 and is divided by the weight its values carry so far,
    1 - (1 - alpha)^t, so that it follows the first steps instead of lagging from the first value (which
    a curve started at the first loss does: 36% of its weight still on step 1 after 20 steps).
    `start`: continue a curve whose last value it is (fully warmed up: no correction)."""
    out: list[float] = []
    acc, weight = (0.0, 0.0) if start is None else (start, 1.0)
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        if start is None:
            weight = (1 - alpha) * weight + alpha
            out.append(acc / weight)
        else:
            out.append(acc)
    return out


def ema(values: list[float], alpha: float = 0.05) -> float:
    curve = ema_curve(values, alpha)
    return curve[-1] if curve else math.nan


class LossWriter:
    """Appends one line per step; opened once per trainer start, which opens a new segment."""

    def __init__(self, run: RunDir, warn: Callable[[str], None] = print):
        self.run = run
        self.warn = warn
        self._failing = False  # the last append failed (a full disk): its lines wait in memory
        if run.exists(LOSS_LOG):  # checked before the whole file is read (or, on a store, downloaded)
            size = run.size(LOSS_LOG)
            check_limit(size, "ANDREA_MAX_LOSS_LOG_BYTES", f"{run.path(LOSS_LOG)}: {size} bytes")
        # On a store without append this is a mirror in the run cache, published at durable flushes.
        self._file = run.open_append(LOSS_LOG)
        raw = self._file.read()
        entries, _ = parse_entries(raw)
        self.segment = max((e.segment for e in entries), default=0) + 1
        self._opened = awake_clock()  # "elapsed" counts from here
        self._buffer: list[bytes] = []
        # The part of a line between "lr" and "time" changes only with the arm (and the batch shape).
        self._middles: dict[tuple[str | None, int], str] = {}

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        arm: str | None,
        tokens: int,
        t: float,
        grad_norm: float | None = None,
    ) -> None:
        loss, lr, t = float(loss), float(lr), round(t, 3)
        elapsed = round(awake_clock() - self._opened, 3)
        # One check for all of them: a sum of finite floats is finite unless it overflows, and an
        # overflow only sends the line down the json.dumps path below, which writes the same text.
        g = 0.0 if grad_norm is None else float(grad_norm)
        if math.isfinite(loss + lr + t + g):
            middle = self._middles.get((arm, tokens))
            if middle is None:
                middle = f',"arm":{json.dumps(arm)},"tokens":{tokens:d},"segment":{self.segment},"time":'
                self._middles[(arm, tokens)] = middle
            # Exactly json.dumps' text (repr of finite floats), without building a dict and an encoder.
            tail = "" if grad_norm is None else f',"grad_norm":{g!r}'
            line = f'{{"step":{step:d},"loss":{loss!r},"lr":{lr!r}{middle}{t!r},"elapsed":{elapsed!r}{tail}}}'
            line += "\n"
        else:
            entry = {"step": step, "loss": loss, "lr": lr, "arm": arm, "tokens": tokens}
            entry = {**entry, "segment": self.segment, "time": t, "elapsed": elapsed}
            if grad_norm is not None:
                entry["grad_norm"] = g
            line = json.dumps(entry, separators=(",", ":")) + "\n"
        self._buffer.append(line.encode())

    def flush(self, durable: bool = False) -> None:
        """Append what was logged since the last flush. `durable` (at every checkpoint and at exit)
        fsyncs it, or on an object store publishes it: what a crash may lose ends there."""
        if self._buffer or durable:
            data, self._buffer = b"".join(self._buffer), []
            try:
                self._file.write(data, durable=durable)
            except OSError as e:
                if durable:  # a checkpoint's history must be on disk: this stops the checkpoint
                    raise
                # A full disk stops the log's appends, not training: the file keeps what it has (a torn
                # last line at most) and the lines not written yet are written, in order, once space is
                # freed. A crash meanwhile loses them, as it loses any step since the last checkpoint.
                if not self._failing:
                    self.warn(
                        f"ERROR: {self.run.path(LOSS_LOG)} could not be appended to ({e}); its lines are "
                        "kept in memory and written once there is space"
                    )
                self._failing = True
                return
            if self._failing:
                self.warn(f"{self.run.path(LOSS_LOG)}: appending again, no line was lost")
                self._failing = False

    def sync(self) -> None:
        """fsync what was flushed; safe from the checkpoint writer's thread while logging goes on."""
        self._file.write(b"", durable=True)

    def close(self) -> None:
        try:
            self.flush(durable=True)
        finally:
            self._file.close()
