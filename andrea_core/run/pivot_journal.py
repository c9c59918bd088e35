"""pivot.json, the journal of a pivot under way (docs/design.md "Pivot sequence"): its format, its
reader and writer, the checkpoints it keeps from retention, and the trainer's own check that no pivot
was left half done. Takes a RunDir; the pivot's steps that write it are in ops/pivot.py."""

from __future__ import annotations

import re
import time
from typing import Any, Protocol

from andrea_core.config import ConfigError
from andrea_core.document import DocumentError, Field, check
from andrea_core.run.lineage import PHASE_FOLDER_RE
from andrea_core.run.rundir import RunDir

PIVOT_JSON = "pivot.json"  # a pivot under way (record_pivot); absent when none is
PIVOT_FORMAT = 1
# The journal's steps, in order (ops/pivot.py): each is written once it is reached.
PIVOT_STEPS = (
    "intent",
    "checkpointed",
    "stopped",
    "archiving",
    "archived",
    "loss-kept",
    "installed",
    "restarted",
)
# Between these the trainer is stopped and the run directory is neither the old phase nor the new one:
# a trainer refuses to start (require_no_half_pivot) until the pivot is rerun or abandoned.
HALF_DONE_STEPS = ("stopped", "archiving", "archived", "loss-kept")
# A pivot request's id (`andrea pivot --request-id`, the flow's request_id): the journal and the phase
# folder it closes record it, so that a rerun of the request finds it done (ops/pivot.already_pivoted).
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


class PolicyId(Protocol):
    """What the journal records of a policy (a data.policy.Policy is one): its name and content hash."""

    name: str
    hash: str


def record_pivot(
    run: RunDir,
    policy: PolicyId,
    step: str,
    boundary: int | None,
    not_before: int | None = None,
    **journal: Any,
) -> dict[str, Any]:
    """Write pivot.json, the record of a pivot under way, before the step it names is taken:

        {"format": 1, "policy": NAME, "policy_hash": HASH, "boundary": B or null,
         "not_before": S or null, "step": one of PIVOT_STEPS, "started_at": T0, "updated_at": T}

    `step` is the last step reached (PIVOT_STEPS; "intent": the pivot point chosen, not yet on disk).
    Retention keeps checkpoint `boundary` while the file exists; with boundary null (a SIGUSR1
    checkpoint not written yet) it keeps every checkpoint from `not_before` on. `journal` adds the
    pivot journal's fields (ops/pivot.py); those of an earlier record of the same pivot (same
    policy hash) are kept unless given again. The pivot removes the file once it is complete."""
    if step not in PIVOT_STEPS:
        raise ValueError(f"pivot step {step!r}: expected one of {PIVOT_STEPS}")
    earlier = read_pivot(run) or {}
    same = earlier.get("policy_hash") == policy.hash
    now = time.time()
    doc = {
        **(earlier if same else {}),
        **journal,
        "format": PIVOT_FORMAT,
        "policy": policy.name,
        "policy_hash": policy.hash,
        "boundary": boundary,
        "not_before": not_before,
        "step": step,
        "started_at": earlier.get("started_at", now) if same else now,
        "updated_at": now,
    }
    run.write_json(PIVOT_JSON, doc)
    return doc


def read_pivot(run: RunDir) -> dict[str, Any] | None:
    """The pivot under way, or None. An unreadable file, or one whose fields are not what record_pivot
    writes (a forged journal), is reported as {"unreadable": why}: one that protects everything and
    that no step acts on. Whatever names a place must be a phase folder of this run."""
    try:
        doc = run.read_json(PIVOT_JSON)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        _check_journal(doc)
        return doc
    except FileNotFoundError:  # none (the run's folder not even there)
        return None
    except ValueError as e:
        why = str(e) if isinstance(e, JournalError) else type(e).__name__
        return {"unreadable": f"{run.path(PIVOT_JSON)}: {why}"}


class JournalError(ValueError):
    """A pivot.json field that record_pivot never writes."""


_STEP = Field((int,), null=True, required=False, low=0, says="is not a step")
_TEXT = Field((str,), null=True, required=False, kind="text")
JOURNAL_SCHEMA: dict[str, Field] = {
    "step": Field((str,), choices=PIVOT_STEPS, says="is not a pivot step"),
    "boundary": _STEP,
    "not_before": _STEP,
    "max_steps": _STEP,
    "archive": Field(
        (str,),
        null=True,
        required=False,
        pattern=PHASE_FOLDER_RE,
        says="is not a phase folder of this run (archive/phase_NNN_step_NNNNNN)",
    ),
    **dict.fromkeys(("policy", "policy_hash", "policy_text", "source", "at", "restart"), _TEXT),
    "request_id": Field(
        (str,), null=True, required=False, pattern=REQUEST_ID_RE, says="is not a pivot request id"
    ),
}


def _check_journal(doc: dict[str, Any]) -> None:
    try:
        check(doc, JOURNAL_SCHEMA)
    except DocumentError as e:
        raise JournalError(str(e)) from None


def clear_pivot(run: RunDir) -> None:
    if run.exists(PIVOT_JSON):
        run.remove(PIVOT_JSON)


def pivot_protected_steps(run: RunDir, steps: list[int]) -> dict[int, str]:
    """The checkpoints among `steps` that a pivot under way needs kept, with the reason."""
    doc = read_pivot(run)
    if doc is None:
        return {}
    if "unreadable" in doc:
        return dict.fromkeys(steps, f"pivot.json unreadable ({doc['unreadable']}): nothing deleted")
    why = f"pivot under way (to policy {doc.get('policy')!r}, step {doc.get('step')!r})"
    if doc.get("boundary") is not None:
        return {doc["boundary"]: why}
    if doc.get("not_before") is not None:
        return {s: why for s in steps if s >= doc["not_before"]}
    return {}


def half_done_message(run: RunDir, journal: dict) -> str:
    source = journal.get("source") or journal.get("policy")
    return (
        f"{run.path(PIVOT_JSON)}: a pivot to policy {journal.get('policy')!r} is half done (last step "
        f"{journal.get('step')!r}, boundary {journal.get('boundary')}): finish it by rerunning the pivot "
        f"(andrea pivot {run.url} --policy {source}) or abandon it and restore the old phase "
        f"(andrea pivot {run.url} --abandon)"
    )


def require_no_half_pivot(run: RunDir) -> None:
    """The trainer's check before it starts: never train a run directory a pivot left half done (its
    bandit state archived but the old policy still installed, or a tail checkpoint not yet moved)."""
    journal = read_pivot(run)
    if journal is None:
        return
    if "unreadable" in journal:
        raise ConfigError(
            f"{journal['unreadable']}: the pivot journal is unreadable, so whether a pivot is half done "
            "cannot be told: inspect it, then remove it"
        )
    if journal.get("step") in HALF_DONE_STEPS:
        raise ConfigError(half_done_message(run, journal))
