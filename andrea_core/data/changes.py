"""data.jsonl: the run's history of its data, so that the run says when its data changed.

At every trainer start, each arm's source fingerprint is compared with the one the run last recorded:

  {"step", "arm", "event", "fingerprint", "time"[, "previous", "why"]}    one JSON object per line

  loaded       the first start that saw the arm with its source available
  changed      files were added, removed or replaced since (the fingerprint differs): the arm's token
               cache is the new source's, rebuilt if this machine had none, and a warning names the arm
  unavailable  the arm's source is gone (the zombie case: dropped, never pulled; state.py says so too),
               or was not there the first time the arm appeared (a pivot and a new run refuse that
               before anything is touched: pipeline.require_available; a trainer records it)
  returned     an arm that was unavailable has its source back
  caps_scaled  the arms left without the unavailable ones (named, comma-separated, in "arm") have caps
               summing below 1: each is scaled by one factor to sum to 1 (policy.live_caps), and the
               run trains on: {"caps": {arm: cap in force}, "scale": factor}; written when it starts
               and whenever the caps in force change
  caps_restored  every arm is back (or the caps left reach 1 again): the policy's caps hold again
               ("caps": the policy's, "arm": the arms that returned)

The file is appended to only, like forks.jsonl, and stays where it is across pivots; a line that is not
such an object (torn by a crash, junk, the wrong shape) is skipped and counted, like a torn .loss.json
line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from andrea_core.data.policy import Policy, live_caps
from andrea_core.document import Field, check
from andrea_core.run.loss_log import well_formed_lines
from andrea_core.run.rundir import RunDir

DATA_LOG = "data.jsonl"
ARM_EVENTS = ("loaded", "changed", "unavailable", "returned")  # one arm's: its newest is its standing
CAPS_EVENTS = ("caps_scaled", "caps_restored")  # the run's caps: the newest is in force
EVENTS = ARM_EVENTS + CAPS_EVENTS


ENTRY_SCHEMA = {  # a data.jsonl line ("time", "previous", "why" are for people, not checked)
    "step": Field((int,)),
    "arm": Field((str,)),
    "event": Field((str,), choices=EVENTS),
    "fingerprint": Field((str,), null=True, required=False),
}
CAPS_SCHEMA = {  # what a caps event adds
    "caps": Field(
        (dict,), test=lambda caps: all(isinstance(k, str) and type(v) is float for k, v in caps.items())
    ),
    "scale": Field((float,), finite=False),
}


def _entry(e: Any) -> dict[str, Any]:
    check(e, ENTRY_SCHEMA)
    return e if e["event"] in ARM_EVENTS else check(e, CAPS_SCHEMA)


def caps_in_force(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest caps_scaled entry if it is still in force (no caps_restored after it), else None."""
    last = next((e for e in reversed(entries) if e["event"] in CAPS_EVENTS), None)
    return last if last is not None and last["event"] == "caps_scaled" else None


def unavailable_arms(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The arms whose newest entry says unavailable: arm -> that entry."""
    last = {e["arm"]: e for e in entries if e["event"] in ARM_EVENTS}
    return {a: e for a, e in last.items() if e["event"] == "unavailable"}


def read_data_log(run: RunDir, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The well-formed entries of data.jsonl, in order; the others are skipped and, through `warn`,
    counted and named by line number."""
    if not run.exists(DATA_LOG):
        return []
    return _entries(run, run.read_bounded(DATA_LOG), warn)


def _entries(run: RunDir, data: bytes, warn: Callable[[str], None] | None) -> list[dict[str, Any]]:
    return well_formed_lines(data, _entry, run.path(DATA_LOG), warn)


def record_data_changes(
    run: RunDir,
    arms: Mapping[str, Any],
    unavailable: Mapping[str, str],
    step: int,
    warn: Callable[[str], None],
    policy: Policy | None = None,
) -> list[dict[str, Any]]:
    """Append what changed since the run's last start; `arms` map names to objects with a fingerprint.
    With `policy`, also the caps in force over the available arms when they are not the policy's
    (caps_scaled, warned at every start it holds), and their return to the policy's (caps_restored)."""
    data = run.read_bounded(DATA_LOG) if run.exists(DATA_LOG) else b""
    entries = _entries(run, data, warn)
    # Each arm's entry in force at `step`: the newest appended at or before it. A resume from before a
    # recorded change (a rollback, a fork of an earlier step) retrains those steps on today's source.
    last = {e["arm"]: e for e in entries if e["event"] in ARM_EVENTS and e["step"] <= step}
    now = time.time()
    new: list[dict[str, Any]] = []
    for name, arm in arms.items():
        prev = last.get(name)
        entry = {"step": step, "arm": name, "fingerprint": arm.fingerprint, "time": now}
        if prev is None:
            new.append({**entry, "event": "loaded"})
        elif prev.get("event") == "unavailable":
            new.append({**entry, "event": "returned"})
        elif prev.get("fingerprint") != arm.fingerprint:
            new.append({**entry, "event": "changed", "previous": prev.get("fingerprint")})
            warn(
                f"warning: arm {name!r}: its source changed since step {prev['step']} (fingerprint "
                f"{prev.get('fingerprint')} -> {arm.fingerprint}): its token cache was rebuilt for the new "
                f"source; recorded in {DATA_LOG} at step {step}"
            )
    for name, why in unavailable.items():
        prev = last.get(name)
        if prev is None or prev.get("event") != "unavailable":  # gone, or never there
            new.append({"step": step, "arm": name, "event": "unavailable", "fingerprint": None, "why": why,
                        "time": now})  # fmt: skip
    if policy is not None:
        new += _caps_change(policy, list(arms), unavailable, caps_in_force(entries), step, now, warn)
    if new:
        # After a torn last line, on a line of its own: never glued onto the torn one.
        torn = b"\n" if data and not data.endswith(b"\n") else b""
        lines = "".join(json.dumps(e, sort_keys=True) + "\n" for e in new).encode()
        run.append(DATA_LOG, torn + lines, durable=True)
    return new


def _caps_change(
    policy: Policy,
    available: list[str],
    unavailable: Mapping[str, str],
    scaled: dict[str, Any] | None,
    step: int,
    now: float,
    warn: Callable[[str], None],
) -> list[dict[str, Any]]:
    caps, scale = live_caps(policy, available)
    if scale != 1.0:
        missing = ", ".join(a.name for a in policy.arms if a.name not in available)
        in_force = dict(zip(available, caps, strict=True))
        before = ", ".join(f"{a} {policy.arm(a).cap:g}" for a in available)
        after = ", ".join(f"{a} {c:.4g}" for a, c in in_force.items())
        warn(
            f"warning: without the unavailable arm(s) {missing}, the caps of {before} sum to {1 / scale:.4g} "
            f"< 1: each is scaled x{scale:.4g} to sum to 1 ({after}) and training goes on; the policy's caps "
            f"hold again once the arm(s) return ({DATA_LOG})"
        )
        if scaled is not None and scaled["caps"] == in_force:
            return []
        return [{"step": step, "arm": missing, "event": "caps_scaled", "fingerprint": None, "caps": in_force,
                 "scale": scale, "why": "; ".join(f"{a}: {w}" for a, w in unavailable.items()),
                 "time": now}]  # fmt: skip
    if scaled is None:
        return []
    caps = {a.name: float(a.cap) for a in policy.arms}
    warn(f"the caps of policy {policy.name!r} hold again: arm(s) {scaled['arm']} returned ({DATA_LOG})")
    return [{"step": step, "arm": scaled["arm"], "event": "caps_restored", "fingerprint": None, "caps": caps,
             "scale": 1.0, "time": now}]  # fmt: skip
