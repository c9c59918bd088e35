"""`.loss.json` (contract): the run's append-only audit trail, as JSON Lines.

One object per line: {"step", "loss", "lr", "arm", "tokens", "segment", "time"}. Never rewritten,
truncated, archived or moved. Each trainer start opens a new segment; after a resume from step S the
steps above S are logged again under it. The canonical history is, for each step, the entry of the
newest segment, with an abandoned timeline's tail (steps past a later resume point) dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from andrea_core.rundir import LOSS_LOG, RunDir


@dataclass(frozen=True)
class LossEntry:
    step: int
    loss: float
    lr: float
    arm: str | None
    tokens: int
    segment: int
    time: float


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


def canonical(entries: list[dict]) -> list[LossEntry]:
    """The history the run actually has: for each step, the newest segment's entry."""
    history: dict[int, dict] = {}
    segment = None
    for e in entries:
        if e["segment"] != segment:
            # A new segment starts right after its resume point: whatever the older timelines
            # logged from that step on was lost with them.
            segment = e["segment"]
            history = {s: v for s, v in history.items() if s < e["step"]}
        history[e["step"]] = e
    return [
        LossEntry(
            int(e["step"]),
            float(e["loss"]),
            float(e.get("lr", math.nan)),
            e.get("arm"),
            int(e.get("tokens", 0)),
            int(e["segment"]),
            float(e.get("time", 0.0)),
        )
        for _, e in sorted(history.items())
    ]


def read_history(run: RunDir) -> list[LossEntry]:
    if not run.exists(LOSS_LOG):
        return []
    return canonical(parse_lines(run.read_bytes(LOSS_LOG))[0])


def ema(values: list[float], alpha: float = 0.05) -> float:
    out = math.nan
    for v in values:
        out = v if math.isnan(out) else (1 - alpha) * out + alpha * v
    return out


class LossWriter:
    """Appends one line per step; opened once per trainer start, which opens a new segment."""

    def __init__(self, run: RunDir):
        self.run = run
        # On a store without append this is a mirror in the run cache, published at durable flushes.
        self._file = run.open_append(LOSS_LOG)
        raw = self._file.read()
        entries, _ = parse_lines(raw)
        self.segment = max((int(e["segment"]) for e in entries), default=0) + 1
        self._buffer: list[bytes] = []
        if raw and not raw.endswith(b"\n"):
            # Terminate a torn last line so our first entry does not glue onto it.
            self._file.write(b"\n", durable=True)

    def log(self, step: int, loss: float, lr: float, arm: str | None, tokens: int, t: float) -> None:
        entry = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "arm": arm,
            "tokens": tokens,
            "segment": self.segment,
            "time": round(t, 3),
        }
        self._buffer.append(json.dumps(entry, separators=(",", ":")).encode() + b"\n")

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
