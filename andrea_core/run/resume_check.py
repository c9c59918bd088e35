"""`segments.jsonl` (contract): what each `.loss.json` segment trained under, and the resume check of a
trainer that trained again steps an earlier segment had logged (issue 46.4).

After a crash the steps between the newest checkpoint and the crash are trained again, and .loss.json
already holds the first training's losses for them. The resumed trainer compares each such step's loss
with the logged one (ResumeCheck) and records the verdict: equal to the bit where that is promised (the
CPU, and the same world size, thread count, environment, data and bandit: docs/design.md "Determinism"),
else the largest difference and why equality was not promised. A difference where it was promised is a
warning naming the steps. `andrea status` and the dashboard show the newest verdict (newest_check).

JSON Lines, append-only (RunDir.append), one object a line; a malformed line is skipped with a warning:
  {"format": 1, "event": "opened", "segment", "start_step", "conditions": {...}, "time"}
  {"format": 1, "event": "checked", "segment", "first", "last", "steps", "against", "promised", "why",
   "equal", "max_diff", "differing", "time"}
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Callable
from typing import Any

from andrea_core.config import ConfigError
from andrea_core.run.guard_events import read_events
from andrea_core.run.loss_log import read_history, well_formed_lines
from andrea_core.run.rundir import RunDir

SEGMENTS = "segments.jsonl"
FORMAT = 1
SHOWN_STEPS = 10  # differing steps named in a record and a warning


def _ints(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 1000 and all(type(v) is int for v in value)


def _record(obj: Any) -> dict | None:
    """A line of segments.jsonl with every field of its kind well typed, or None (skipped as malformed):
    a forged line never breaks a resume or a status."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or type(obj.get("segment")) is not int:
        return None
    if obj.get("event") == "opened":
        ok = type(obj.get("start_step")) is int and isinstance(obj.get("conditions"), dict)
    elif obj.get("event") == "checked":
        ok = (
            all(type(obj.get(k)) is int for k in ("first", "last", "steps"))
            and all(type(obj.get(k)) is bool for k in ("promised", "equal"))
            and (obj.get("max_diff") is None or type(obj.get("max_diff")) in (int, float))
            and (obj.get("why") is None or isinstance(obj.get("why"), str))
            and _ints(obj.get("against"))
            and _ints(obj.get("differing"))
        )
    else:
        ok = False
    return obj if ok else None


def read_records(run: RunDir, warn: Callable[[str], None] | None = None) -> list[dict]:
    try:
        data = run.read_bounded(SEGMENTS, "ANDREA_MAX_SIDECAR_BYTES")
    except FileNotFoundError:
        return []
    return well_formed_lines(data, _record, run.path(SEGMENTS), warn)


def newest_check(run: RunDir, warn: Callable[[str], None] | None = None) -> dict | None:
    """The newest resume check's record (None: no resumed trainer has trained a logged step again, or
    the file is past its bound: said through `warn`)."""
    try:
        records = read_records(run, warn)
    except ConfigError as e:
        if warn is not None:
            warn(str(e))
        return None
    checks = [r for r in records if r["event"] == "checked"]
    return checks[-1] if checks else None


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}..{last}"


def describe(record: dict) -> str:
    """The verdict in one line, as the trainer logs it and `andrea status` shows it."""
    steps, against = _steps(record["first"], record["last"]), ", ".join(map(str, record.get("against", [])))
    if record["equal"]:
        verdict = f"resume verified: {steps} equal to the bit"
        if not record["promised"]:
            verdict += f" (not promised: {record.get('why')})"
        return f"{verdict} (segment {record['segment']} against {against})"
    md = record.get("max_diff")
    largest = "a non-finite difference" if md is None else f"largest difference {md:.3g}"
    if record["promised"]:
        shown = ", ".join(map(str, record["differing"]))
        more = len(record["differing"]) < (record.get("n_differing") or 0)
        return (
            f"WARNING: resume NOT verified: step(s) {shown}{', ...' if more else ''} of {steps} differ from "
            f"segment {against}'s logged losses ({largest}) where equality is promised (the CPU, the same "
            "threads, world size, environment, data and bandit): the resumed training is not the one logged"
        )
    why = record.get("why")
    return f"resume check: {steps} {largest} from segment {against}'s (equality not promised: {why})"


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _differences(then: dict, now: dict) -> list[str]:
    """Why equality to the bit is not promised between a segment of `then` and one of `now`."""
    whys = []
    for name, cond in (("then", then), ("now", now)):
        if cond.get("device") != "cpu":
            whys.append(f"{cond.get('device')} {name}: on CUDA exact bits are not promised")
    for key, what in (("world_size", "world size"), ("num_threads", "threads")):
        if then.get(key) != now.get(key):
            whys.append(f"{what} {then.get(key)} then {now.get(key)}")
    env_then, env_now = _mapping(then.get("environment")), _mapping(now.get("environment"))
    for key in sorted(set(env_then) | set(env_now)):
        if env_then.get(key) != env_now.get(key):
            whys.append(f"{key} {env_then.get(key)} then {env_now.get(key)}")
    data_then, data_now = _mapping(then.get("data")), _mapping(now.get("data"))
    for arm in sorted(set(data_then) | set(data_now)):
        if data_then.get(arm) != data_now.get(arm):
            whys.append(f"arm {arm}'s data changed")
    if not now.get("bandit_restored", True):
        whys.append("the bandit started fresh")
    return whys


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class ResumeCheck:
    """One trainer segment's check: opened at its start (its conditions recorded), told each step's loss
    (observe), finished when it has trained the last step an earlier segment logged, at a rollback or at
    exit (finish): one "checked" record and one log line, if it trained any such step at all."""

    def __init__(
        self,
        run: RunDir,
        segment: int,
        start_step: int,
        conditions: dict,
        log: Callable[[str], None],
        compare: bool = True,
    ):
        self.run, self.segment, self.log = run, segment, log
        self.logged: dict[int, tuple[float, int]] = {}  # step -> (earlier loss, its segment)
        self.whys: dict[int, list[str]] = {}  # segment -> why equality is not promised against it
        self.done, self.end = False, None
        self.first = self.last = None
        self.compared, self.max_diff, self.differing, self.n_differing = 0, 0.0, [], 0
        self.against: set[int] = set()
        if compare:
            try:
                self._gather(read_records(run, warn=log), start_step, conditions)
            except Exception as e:  # a view of the run: its failure is a warning, never the end of training
                self.logged.clear()
                log(f"warning: no resume check this start: {type(e).__name__}: {e}")
        self._append(
            {"event": "opened", "segment": segment, "start_step": start_step, "conditions": conditions}
        )

    def _gather(self, records: list[dict], start: int, now: dict) -> None:
        """The earlier segments' logged losses past `start` that this segment will train again under
        the same course: not another phase's (a pivot's old policy), not before a rollback replayed
        from here, past its remedy_from (their remedy came after they were logged; the steps up to
        remedy_from retrain on their own data)."""
        opened = {r["segment"]: r["conditions"] for r in records if r["event"] == "opened"}
        rollbacks = [e for e in read_events(self.run) if e.action == "rollback"]
        floors = [e.remedy_from for e in rollbacks if e.remedy_from >= start]
        ceiling = min(floors, default=math.inf)
        for e in read_history(self.run):  # before this segment logs anything: the earlier segments'
            if e.step <= start or e.step > ceiling:
                continue
            then = opened.get(e.segment)
            if then is None:
                if start == now.get("phase_start") and start > 0:
                    continue  # a new phase's first start: what was logged past it may be the old phase's
                self.whys.setdefault(e.segment, [f"segment {e.segment}'s conditions were not recorded"])
            elif then.get("phase_start") != now.get("phase_start") or then.get("policy") != now.get("policy"):
                continue  # another phase trained these steps under another policy
            else:
                self.whys.setdefault(e.segment, _differences(then, now))
            self.logged[e.step] = (e.loss, e.segment)
        self.end = max(self.logged, default=None)

    def _append(self, record: dict) -> None:
        line = json.dumps({"format": FORMAT, **record, "time": round(time.time(), 3)}, allow_nan=False)
        try:
            self.run.append(SEGMENTS, line.encode() + b"\n")
        except Exception as e:  # a record of the run's history, not training: a warning, never the end
            self.log(f"warning: {self.run.path(SEGMENTS)} could not be appended to ({type(e).__name__}: {e})")

    def observe(self, step: int, loss: float) -> None:
        if self.done or step not in self.logged:
            return
        before, segment = self.logged.pop(step)
        self.first = step if self.first is None else self.first
        self.last, self.compared = step, self.compared + 1
        self.against.add(segment)
        if _bits(before) != _bits(loss):
            diff = abs(loss - before)
            self.max_diff = max(self.max_diff, diff if math.isfinite(diff) else math.inf)
            self.n_differing += 1
            if len(self.differing) < SHOWN_STEPS:
                self.differing.append(step)
        if step == self.end:
            self.finish()

    def finish(self) -> dict | None:
        """Record and log the verdict over the steps compared so far (none: nothing is written)."""
        if self.done:
            return None
        self.done = True
        if not self.compared:
            return None
        whys = sorted({w for s in self.against for w in self.whys.get(s, [])})
        record = {
            "event": "checked",
            "segment": self.segment,
            "first": self.first,
            "last": self.last,
            "steps": self.compared,
            "against": sorted(self.against),
            "promised": not whys,
            "why": "; ".join(whys) or None,
            "equal": self.n_differing == 0,
            "max_diff": self.max_diff if math.isfinite(self.max_diff) else None,
            "differing": self.differing,
            "n_differing": self.n_differing,
        }
        self._append(record)
        self.log(describe(record))
        return record
