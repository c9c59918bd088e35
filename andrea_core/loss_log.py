"""`.loss.json` (contract): the run's append-only audit trail, as JSON Lines.

One object per line: {"step", "loss", "lr", "arm", "tokens", "segment", "time"}. Never rewritten,
truncated, archived or moved. Each trainer start opens a new segment; after a resume from step S the
steps above S are logged again under it. The canonical history is, for each step, the entry of the
newest segment, with an abandoned timeline's tail (steps past a later resume point) dropped.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple

from andrea_core.rundir import LOSS_LOG, RunDir


class LossEntry(NamedTuple):
    step: int
    loss: float
    lr: float
    arm: str | None
    tokens: int
    segment: int
    time: float


# Reading fast: a line exactly as LossWriter writes it is 16 fields once its delimiters are one byte,
#   {"step":S,"loss":L,"lr":R,"arm":A,"tokens":T,"segment":G,"time":M}  ->  '' "step" S "loss" L ... M ''
# so a block of such lines becomes columns by slicing, and each column is converted in C (int, float),
# with no json.loads per line. A block with any other line (a torn line, another writer's spacing or key
# order, an arm name with a delimiter in it) is read line by line with json.loads instead.
_DELIMITERS = bytes.maketrans(b"{}:,\n", b"\n\n\n\n\n")
_KEYS = (b'"step"', b'"loss"', b'"lr"', b'"arm"', b'"tokens"', b'"segment"', b'"time"')
_BLOCK = 4096  # lines: a block that falls back to json.loads costs little


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
    )


def parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Parsed entries in file order, and how many lines were skipped as torn or malformed."""
    entries, skipped = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            int(obj["step"]), float(obj["loss"]), int(obj["segment"])
        except (ValueError, KeyError, TypeError):
            skipped += 1  # a crash mid-append leaves a torn line; it never breaks a reader
            continue
        entries.append(obj)
    return entries, skipped


def parse_entries(data: bytes) -> tuple[list[LossEntry], int]:
    """`parse_lines` as LossEntry values, and fast (see _DELIMITERS)."""
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the file ends with a newline
    entries: list[LossEntry] = []
    skipped = 0
    with _collector_paused():
        for i in range(0, len(lines), _BLOCK):
            block = lines[i : i + _BLOCK]
            fast = _writer_lines(block)
            if fast is not None:
                entries += fast
                continue
            for line in block:
                if not line.strip():
                    continue
                try:
                    entries.append(_entry(json.loads(line)))
                except (ValueError, KeyError, TypeError, AttributeError):
                    skipped += 1  # a crash mid-append leaves a torn line; it never breaks a reader
    return entries, skipped


def _writer_lines(lines: list[bytes]) -> list[LossEntry] | None:
    """Entries of lines that are all exactly in LossWriter's shape, or None."""
    n = len(lines)
    fields = b"\n".join(lines).translate(_DELIMITERS).split(b"\n")
    if len(fields) != 16 * n or fields[0::16] != [b""] * n or fields[15::16] != [b""] * n:
        return None
    if any(fields[1 + 2 * k :: 16] != [key] * n for k, key in enumerate(_KEYS)):
        return None
    step, loss, lr, arm, tokens, segment, t = (fields[2 + 2 * k :: 16] for k in range(7))
    # Only what json.dumps writes for finite numbers: int() and float() would also take "inf", "1_0"...
    if any(b"".join(column).translate(None, b"-0123456789") for column in (step, tokens, segment)):
        return None
    if any(b"".join(column).translate(None, b"-+.0123456789eE") for column in (loss, lr, t)):
        return None  # NaN or Infinity somewhere in the block: json.loads reads those
    try:
        name = {a: json.loads(a) for a in set(arm)}
        if not all(v is None or isinstance(v, str) for v in name.values()):
            return None
        columns = (
            map(int, step),
            map(float, loss),
            map(float, lr),
            map(name.__getitem__, arm),
            map(int, tokens),
            map(int, segment),
            map(float, t),
        )
        return list(map(tuple.__new__, repeat(LossEntry), zip(*columns, strict=True)))
    except ValueError:
        return None


def newest_segments(entries: Iterable[LossEntry]) -> list[LossEntry]:
    """The history the run actually has: for each step, the newest segment's entry (file order in)."""
    history: dict[int, LossEntry] = {}
    segment = None
    for e in entries:
        if e.segment != segment:
            # A new segment starts right after its resume point: whatever the older timelines
            # logged from that step on was lost with them.
            segment = e.segment
            history = {s: v for s, v in history.items() if s < e.step}
        history[e.step] = e
    return [history[s] for s in sorted(history)]


def canonical(entries: list[dict]) -> list[LossEntry]:
    """The canonical history of `parse_lines`' entries."""
    return newest_segments(map(_entry, entries))


def read_history(run: RunDir) -> list[LossEntry]:
    if not run.exists(LOSS_LOG):
        return []
    return newest_segments(parse_entries(run.read_bytes(LOSS_LOG))[0])


def ema_curve(values: list[float], alpha: float = 0.05) -> list[float]:
    """The exponential moving average after each value (the smoothed curve of a plot)."""
    out, acc = [], math.nan
    for v in values:
        acc = v if math.isnan(acc) else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def ema(values: list[float], alpha: float = 0.05) -> float:
    curve = ema_curve(values, alpha)
    return curve[-1] if curve else math.nan


class LossWriter:
    """Appends one line per step; opened once per trainer start, which opens a new segment."""

    def __init__(self, run: RunDir):
        self.run = run
        # On a store without append this is a mirror in the run cache, published at durable flushes.
        self._file = run.open_append(LOSS_LOG)
        raw = self._file.read()
        entries, _ = parse_entries(raw)
        self.segment = max((e.segment for e in entries), default=0) + 1
        self._buffer: list[bytes] = []
        # The part of a line between "lr" and "time" changes only with the arm (and the batch shape).
        self._middles: dict[tuple[str | None, int], str] = {}
        if raw and not raw.endswith(b"\n"):
            # Terminate a torn last line so our first entry does not glue onto it.
            self._file.write(b"\n", durable=True)

    def log(self, step: int, loss: float, lr: float, arm: str | None, tokens: int, t: float) -> None:
        loss, lr, t = float(loss), float(lr), round(t, 3)
        # One check for all three: a sum of finite floats is finite unless it overflows, and an overflow
        # only sends the line down the json.dumps path below, which writes the same text.
        if math.isfinite(loss + lr + t):
            middle = self._middles.get((arm, tokens))
            if middle is None:
                middle = f',"arm":{json.dumps(arm)},"tokens":{tokens:d},"segment":{self.segment},"time":'
                self._middles[(arm, tokens)] = middle
            # Exactly json.dumps' text (repr of finite floats), without building a dict and an encoder.
            line = f'{{"step":{step:d},"loss":{loss!r},"lr":{lr!r}{middle}{t!r}}}\n'
        else:
            entry = {"step": step, "loss": loss, "lr": lr, "arm": arm, "tokens": tokens}
            line = json.dumps({**entry, "segment": self.segment, "time": t}, separators=(",", ":")) + "\n"
        self._buffer.append(line.encode())

    def flush(self, durable: bool = False) -> None:
        """Append what was logged since the last flush. `durable` (at every checkpoint and at exit)
        fsyncs it, or on an object store publishes it: what a crash may lose ends there."""
        if self._buffer or durable:
            data, self._buffer = b"".join(self._buffer), []
            self._file.write(data, durable=durable)

    def sync(self) -> None:
        """fsync what was flushed; safe from the checkpoint writer's thread while logging goes on."""
        self._file.write(b"", durable=True)

    def close(self) -> None:
        self.flush(durable=True)
        self._file.close()
