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

The file is appended to only, like forks.jsonl, and stays where it is across pivots; a line that is not
such an object (torn by a crash, junk, the wrong shape) is skipped and counted, like a torn .loss.json
line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from andrea_core.run.loss_log import well_formed_lines
from andrea_core.run.rundir import RunDir

DATA_LOG = "data.jsonl"
EVENTS = ("loaded", "changed", "unavailable", "returned")


def _is_entry(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and type(e.get("step")) is int
        and isinstance(e.get("arm"), str)
        and e.get("event") in EVENTS
        and (e.get("fingerprint") is None or isinstance(e.get("fingerprint"), str))
    )


def read_data_log(run: RunDir, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The well-formed entries of data.jsonl, in order; the others are skipped and, through `warn`,
    counted and named by line number."""
    if not run.exists(DATA_LOG):
        return []
    return _entries(run, run.read_bounded(DATA_LOG), warn)


def _entries(run: RunDir, data: bytes, warn: Callable[[str], None] | None) -> list[dict[str, Any]]:
    return well_formed_lines(data, lambda e: e if _is_entry(e) else None, run.path(DATA_LOG), warn)


def record_data_changes(
    run: RunDir,
    arms: Mapping[str, Any],
    unavailable: Mapping[str, str],
    step: int,
    warn: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Append what changed since the run's last start; `arms` map names to objects with a fingerprint."""
    data = run.read_bounded(DATA_LOG) if run.exists(DATA_LOG) else b""
    last = {e["arm"]: e for e in _entries(run, data, warn)}
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
    if new:
        # After a torn last line, on a line of its own: never glued onto the torn one.
        torn = b"\n" if data and not data.endswith(b"\n") else b""
        lines = "".join(json.dumps(e, sort_keys=True) + "\n" for e in new).encode()
        run.append(DATA_LOG, torn + lines, durable=True)
    return new
