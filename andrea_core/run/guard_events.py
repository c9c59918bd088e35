"""guard.jsonl (contract): the divergence guard's events, one JSON object a line, append-only.

Each line is one event of the guard (guard.py): a rollback (what was detected at which step, against
which statistic and threshold, the checkpoint rolled back to and the remedy applied from there) or the
stop at its bound. The file is the run's record of what happened and, for the trainer, one of its
inputs: the data position a step draws its batch from and its learning-rate factor are a pure function
of (step, these events), so a resume replays every remedy exactly (`Remedies`). A crash mid-append
leaves a torn last line: readers skip it, the next append terminates it first. A fork copies the events
up to its fork point (`events_up_to`); a pivot leaves the file as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from andrea_core.run.loss_log import JSON_LINE_ERRORS, well_formed_lines
from andrea_core.run.rundir import GUARD_LOG, RunDir

FORMAT = 1
KINDS = ("non-finite-loss", "non-finite-grad-norm", "loss-spike", "grad-norm-spike")
ACTIONS = ("rollback", "stop")


@dataclass(frozen=True)
class GuardEvent:
    number: int  # 1, 2, ... in the order the events happened
    action: str  # "rollback" or "stop" (the bound was reached; nothing was rolled back)
    step: int  # the step whose reading completed the divergence
    spike_start: int  # its first spiking step (the step itself for a non-finite one)
    kind: str  # KINDS
    value: float  # the loss or gradient norm that crossed the threshold (NaN, inf for a non-finite one)
    statistic: float | None  # the running median it was judged against (None: non-finite)
    threshold: float | None
    rolled_back_to: int | None  # the checkpoint step training went on from (0: the initial weights)
    level: int  # escalation: rollbacks before this one in its region (guard.rollback_window)
    skip: int  # data positions skipped: step rolled_back_to + 1 draws position rolled_back_to + 1 + skip
    lr_scale: float  # the learning rate's factor for steps rolled_back_to + 1 .. + cooldown
    cooldown: int
    time: float

    def to_line(self) -> bytes:
        return (json.dumps({"format": FORMAT, **asdict(self)}, separators=(",", ":")) + "\n").encode()


def _event(obj: Any) -> GuardEvent:
    """An event from a parsed line; ValueError (or one of JSON_LINE_ERRORS) if it is not one."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError("not a guard event of format 1")
    e = GuardEvent(
        number=int(obj["number"]),
        action=str(obj["action"]),
        step=int(obj["step"]),
        spike_start=int(obj["spike_start"]),
        kind=str(obj["kind"]),
        value=float(obj["value"]),
        statistic=None if obj["statistic"] is None else float(obj["statistic"]),
        threshold=None if obj["threshold"] is None else float(obj["threshold"]),
        rolled_back_to=None if obj["rolled_back_to"] is None else int(obj["rolled_back_to"]),
        level=int(obj["level"]),
        skip=int(obj["skip"]),
        lr_scale=float(obj["lr_scale"]),
        cooldown=int(obj["cooldown"]),
        time=float(obj["time"]),
    )
    for name in ("number", "step", "spike_start", "level", "skip", "cooldown"):
        if isinstance(obj[name], bool) or not 0 <= getattr(e, name) < 2**53:
            raise ValueError(f"{name} {obj[name]!r} is not a count")
    rollback = e.action == "rollback"
    if e.action not in ACTIONS or e.kind not in KINDS:
        raise ValueError(f"unknown action {e.action!r} or kind {e.kind!r}")
    if rollback != (e.rolled_back_to is not None) or (rollback and not 0 <= e.rolled_back_to < e.step):
        raise ValueError("a rollback names a checkpoint before its step; a stop names none")
    if not (0 < e.lr_scale <= 1) or e.spike_start > e.step:
        raise ValueError("lr_scale outside (0, 1] or a spike that starts after its step")
    return e


def read_events(run: RunDir, warn: Callable[[str], None] | None = None) -> list[GuardEvent]:
    """The well-formed events of the run, in file order. A torn or malformed line is skipped (and
    reported through `warn`): it must not stop a resume, a status or a fork."""
    if not run.exists(GUARD_LOG):
        return []
    return parse_events(run.read_bounded(GUARD_LOG), run.path(GUARD_LOG), warn)


def parse_events(
    data: bytes, where: str = GUARD_LOG, warn: Callable[[str], None] | None = None
) -> list[GuardEvent]:
    return well_formed_lines(data, _event, where, warn)


def append_event(run: RunDir, event: GuardEvent) -> None:
    """Append one event durably (fsynced, or on a store published); the appender ends a torn last line
    before the first new byte (RunDir.open_append)."""
    run.append(GUARD_LOG, event.to_line(), durable=True)


def events_up_to(data: bytes, step: int) -> bytes:
    """The lines of a guard.jsonl that belong to a branch forked at `step`, bytes as they were: every
    rollback to a checkpoint before `step` (it shaped the timeline up to the fork point) and every stop
    at or before it. A torn or foreign line is left out."""
    kept = []
    for line in data.split(b"\n"):
        try:
            e = _event(json.loads(line))
        except JSON_LINE_ERRORS:
            continue
        if (e.rolled_back_to is not None and e.rolled_back_to < step) or (
            e.action == "stop" and e.step <= step
        ):
            kept.append(line + b"\n")
    return b"".join(kept)


class Remedies:
    """What the recorded events do to each later step: the data position its batch is drawn from and
    its learning-rate factor. A pure function of the events, in file order.

    A rollback to R acts on steps after R. A later rollback to R' <= R abandons the timeline past R'
    (and with it the earlier event's effect there), so it replaces every active event at or past R'."""

    def __init__(self, events: list[GuardEvent]):
        self.active: list[GuardEvent] = []
        for e in events:
            if e.action == "rollback":
                self.active = [a for a in self.active if a.rolled_back_to < e.rolled_back_to] + [e]

    def data_step(self, step: int) -> int:
        return step + sum(e.skip for e in self.active if e.rolled_back_to < step)

    def lr_factor(self, step: int) -> float:
        factors = [
            e.lr_scale for e in self.active if e.rolled_back_to < step <= e.rolled_back_to + e.cooldown
        ]
        return min(factors, default=1.0)
