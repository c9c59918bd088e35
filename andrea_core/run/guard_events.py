"""guard.jsonl (contract): the divergence guard's events, one JSON object a line, append-only.

Each line is one event of the guard (guard.py): a rollback (what was detected at which step, against
which statistic and threshold, the checkpoint rolled back to, the step its remedy acts after and the
remedy) or the stop at its bound. The remedy's anchor (`remedy_from`) does not depend on which
checkpoints exist: steps rolled_back_to + 1 .. remedy_from retrain on their own data positions, so a
checkpoint a fault left unwritten changes what is retrained, never what the run trains on. Format 1
lines (before remedy_from) read as remedy_from = rolled_back_to. The file is the run's record of what
happened and, for the trainer, one of its inputs: the data position a step draws its batch from and
its learning-rate factor are a pure function of (step, these events), so a resume replays every
remedy exactly (`Remedies`). A crash mid-append leaves a torn last line: readers skip it, the next
append terminates it first. A fork copies the events up to its fork point (`events_up_to`); a pivot
leaves the file as it is.

The file is input like every run file: a line is obeyed only if it is an event this guard could have
written (`_event`: counts in range, lr_scale in [MIN_LR_SCALE, 1], a level below its number, a skip no
larger than its escalated distance) and, for the trainer that replays it, one of this run's
(`replayable_events`: numbers increasing, a rollback to a step where the run's history restarts, a
cooldown bounded by the run's length). Any other line is skipped with a warning naming the file and the
line: never obeyed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from andrea_core.document import Field, check
from andrea_core.run.loss_log import JSON_LINE_ERRORS, json_lines, parse_entries, well_formed_lines
from andrea_core.run.rundir import GUARD_LOG, LOSS_LOG, RunDir

FORMAT = 2  # 2: remedy_from; a format 1 line (without it) reads as remedy_from = rolled_back_to
FORMATS = (1, 2)
# "loss-rise": the loss's level (the mean of its last rise_span steps) above its best by rise_margin for
# rise_steps steps in a row: oscillation and drift (guard.py).
KINDS = ("non-finite-loss", "non-finite-grad-norm", "loss-spike", "grad-norm-spike", "loss-rise")
# The smallest learning-rate factor an event may carry: no guard setting reaches it (config.py refuses
# lr_scale ** max_rollbacks below it); a factor under it would train nothing and call the run healthy.
MIN_LR_SCALE = 1e-6
MAX_LEVEL = 62  # an escalation level beyond any max_rollbacks (2**level stays an exact integer)
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
    skip: int  # data positions skipped: step remedy_from + 1 draws position remedy_from + 1 + skip
    lr_scale: float  # the learning rate's factor for steps remedy_from + 1 .. + cooldown
    cooldown: int
    time: float
    # The step the remedy acts after: max(rolled_back_to, spike_start - rollback_margin), whichever
    # checkpoints a fault left; steps rolled_back_to + 1 .. remedy_from retrain on their own data.
    # None for a stop. A format 1 line has none: it reads as rolled_back_to.
    remedy_from: int | None = None

    def __post_init__(self) -> None:
        if self.remedy_from is None and self.rolled_back_to is not None:
            object.__setattr__(self, "remedy_from", self.rolled_back_to)

    def to_line(self) -> bytes:
        return (json.dumps({"format": FORMAT, **asdict(self)}, separators=(",", ":")) + "\n").encode()


_COUNT = Field((int,), low=0, high=2**53 - 1, says="is not a count")
_REAL = Field((int, float), finite=False)  # NaN and inf are what a non-finite event records
EVENT_SCHEMA = {  # a guard.jsonl line of format 1 or 2; how the fields agree is _event's
    "number": _COUNT,
    "action": Field((str,), choices=ACTIONS),
    "step": _COUNT,
    "spike_start": _COUNT,
    "kind": Field((str,), choices=KINDS),
    "value": _REAL,
    "statistic": dataclasses.replace(_REAL, null=True),
    "threshold": dataclasses.replace(_REAL, null=True),
    "rolled_back_to": Field((int,), null=True),
    "level": _COUNT,
    "skip": _COUNT,
    "lr_scale": _REAL,
    "cooldown": _COUNT,
    "time": _REAL,
    "remedy_from": Field((int,), null=True, required=False),  # format 2: required (_event)
}


def _event(obj: Any) -> GuardEvent:
    """An event from a parsed line; ValueError (or one of JSON_LINE_ERRORS) if it is not one."""
    if not isinstance(obj, dict) or obj.get("format") not in FORMATS:
        raise ValueError(f"not a guard event of format {' or '.join(map(str, FORMATS))}")
    if (obj["format"] == 1) == ("remedy_from" in obj):
        raise ValueError("remedy_from is a field of format 2 (and required there), not of format 1")
    check(obj, EVENT_SCHEMA)
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
        remedy_from=obj.get("remedy_from"),
    )
    rollback = e.action == "rollback"
    if rollback != (e.rolled_back_to is not None) or (rollback and not 0 <= e.rolled_back_to < e.step):
        raise ValueError("a rollback names a checkpoint before its step; a stop names none")
    if not (MIN_LR_SCALE <= e.lr_scale <= 1) or e.spike_start > e.step:
        raise ValueError(f"lr_scale outside [{MIN_LR_SCALE:g}, 1] or a spike that starts after its step")
    if e.number < 1 or e.level >= e.number or e.level > MAX_LEVEL:
        raise ValueError(f"level {e.level} is not below the event's number {e.number}")
    if rollback and obj["format"] > 1 and obj["remedy_from"] is None:
        raise ValueError("a rollback of format 2 names its remedy_from")
    if rollback and not e.rolled_back_to <= e.remedy_from < e.step:
        raise ValueError(f"remedy_from {e.remedy_from} outside [rolled_back_to, step)")
    if not rollback and obj.get("remedy_from") is not None:
        raise ValueError("a stop has no remedy_from")
    if rollback and e.skip > (e.step - e.remedy_from) * 2**e.level:
        raise ValueError(f"skip {e.skip} beyond its escalated distance (step - remedy_from) x 2^level")
    if not rollback and (e.skip or e.cooldown or e.lr_scale != 1):
        raise ValueError("a stop carries no remedy")
    return e


def lr_changes(events: list[GuardEvent]) -> list[tuple[int, int, float]]:
    """What the events did to the learning rate of the run's canonical timeline: (first step, last
    step, factor) for each stretch trained at a factor below 1, in step order (`Remedies`). For a report
    that says under which settings a run actually trained after its divergences."""
    remedies = Remedies(events)
    out = []
    for e in sorted(remedies.active, key=lambda a: a.remedy_from):
        if e.lr_scale < 1 and e.cooldown:
            out.append((e.remedy_from + 1, e.remedy_from + e.cooldown, e.lr_scale))
    return out


def event_of(record: Mapping[str, Any]) -> GuardEvent:
    """The event of a record that carries its fields (status's and compare's asdict(event) plus keys of
    their own)."""
    return GuardEvent(**{f.name: record[f.name] for f in fields(GuardEvent) if f.name in record})


def remedy_clauses(e: GuardEvent) -> list[str]:
    """A rollback's remedy in words, a clause for each part that did something: the steps retrained on
    their own data (rolled_back_to + 1 .. remedy_from), the data positions skipped, the learning rate's
    factor and the steps it held. The one wording of it: the trainer's line, status, fork reports."""
    first, out = e.remedy_from + 1, []
    if e.remedy_from > e.rolled_back_to:
        out.append(f"steps {e.rolled_back_to + 1}..{e.remedy_from} retrained on their own data")
    if e.skip:
        out.append(f"data positions {first}..{first + e.skip - 1} skipped")
    if e.lr_scale < 1 and e.cooldown:
        out.append(f"lr x{e.lr_scale:.3g} for steps {first}..{first + e.cooldown - 1}")
    return out


def remedy_text(e: GuardEvent) -> str:
    """remedy_clauses joined, "no remedy" where there are none (status's guard row, fork reports)."""
    return ", ".join(remedy_clauses(e)) or "no remedy"


def describe_event(e: GuardEvent) -> str:
    """One line: what the event detected and what was done (status, reports, the trainer's replay log)."""
    if e.action == "stop":
        return f"event {e.number}: {e.kind} at step {e.step}: stopped the run"
    remedy = [f"rolled back to step {e.rolled_back_to}", *remedy_clauses(e)]
    return f"event {e.number}: {e.kind} at step {e.step} (since step {e.spike_start}): {', '.join(remedy)}"


def replayable_events(
    run: RunDir, horizon: int, start_step: int, warn: Callable[[str], None]
) -> list[GuardEvent]:
    """The events a trainer starting at checkpoint `start_step` obeys, in file order: each line is an
    event (`_event`) and one of this run's: its number above the one before, a rollback to the initial
    weights, to `start_step` or to a step R whose history restarts at R + 1 in .loss.json (a rollback
    opens a segment there; a fork copies the segments up to its fork point), a cooldown of at most
    max(horizon, its step) x 2^level steps (`horizon`: the run's length, the longest of its target,
    its learning-rate schedule and its guard's cooldown_steps). Any other line is
    skipped with one warning naming the file and the line, never obeyed."""
    if not run.exists(GUARD_LOG):
        return []
    where = run.path(GUARD_LOG)
    parsed, bad = json_lines(run.read_bounded(GUARD_LOG))
    if bad:
        lines = ", ".join(map(str, bad))
        warn(f"{where}: skipped {len(bad)} malformed line(s) (torn by a crash?): lines {lines}")
    restarts = {0, start_step}
    if run.exists(LOSS_LOG) and parsed:
        first: dict[int, int] = {}
        for entry in parse_entries(run.read_bounded(LOSS_LOG, "ANDREA_MAX_LOSS_LOG_BYTES"))[0]:
            first[entry.segment] = min(first.get(entry.segment, entry.step), entry.step)
        restarts |= {s - 1 for s in first.values()}
    out: list[GuardEvent] = []
    for number, value in parsed:
        try:
            e = _event(value)
            if out and e.number <= out[-1].number:
                raise ValueError(f"number {e.number} after event {out[-1].number}: not in order")
            if e.rolled_back_to is not None and e.rolled_back_to not in restarts:
                raise ValueError(
                    f"rolled_back_to {e.rolled_back_to}: the run's history never restarted after that step "
                    "(no checkpoint of this run was rolled back to there)"
                )
            if e.cooldown > max(horizon, e.step) * 2**e.level:
                raise ValueError(f"cooldown {e.cooldown} beyond the run's length ({horizon} steps) x 2^level")
        except JSON_LINE_ERRORS as err:
            warn(f"{where}: line {number}: not obeyed, skipped: {err}")
            continue
        out.append(e)
    return out


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
    rollback whose remedy acts from before `step` (remedy_from < step: it shaped the timeline up to the
    fork point; one whose remedy starts at or past it did not, whichever checkpoint it went back to)
    and every stop at or before it. A torn or foreign line is left out."""
    kept = []
    for line in data.split(b"\n"):
        try:
            e = _event(json.loads(line))
        except JSON_LINE_ERRORS:
            continue
        if (e.remedy_from is not None and e.remedy_from < step) or (e.action == "stop" and e.step <= step):
            kept.append(line + b"\n")
    return b"".join(kept)


class Remedies:
    """What the recorded events do to each later step: the data position its batch is drawn from and
    its learning-rate factor. A pure function of the events, in file order.

    A rollback acts on the steps after its remedy_from F (the steps from its checkpoint to F retrain
    exactly as the abandoned timeline trained them, under the events active then). It abandons the
    timeline past F, and with it every active event whose remedy acts from F or later (none of them
    touched a step up to F): those are replaced; the ones acting from before F stay."""

    def __init__(self, events: list[GuardEvent]):
        self.active: list[GuardEvent] = []
        for e in events:
            if e.action == "rollback":
                self.active = [a for a in self.active if a.remedy_from < e.remedy_from] + [e]

    def data_step(self, step: int) -> int:
        return step + sum(e.skip for e in self.active if e.remedy_from < step)

    def lr_factor(self, step: int) -> float:
        factors = [e.lr_scale for e in self.active if e.remedy_from < step <= e.remedy_from + e.cooldown]
        return min(factors, default=1.0)
