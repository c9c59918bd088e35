"""The polish pivot's run-directory steps (DESIGN.md "Pivot sequence", steps 3 to 5).

Stopping and starting the trainer belongs to whoever orchestrates (Prefect's `pivot` flow, or an
operator in a shell); this module only rearranges the run directory, and only while no trainer runs.
It also holds what an orchestrator needs around those steps: `check_pivot`, every check of a pivot's
parameters made before anything is touched, and `pivot.json`, the record of a pivot under way that
keeps retention away from its checkpoint until the phase is archived (format in record_pivot).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from andrea_core.checkpoint import CheckpointError, checkpoint_name
from andrea_core.config import ConfigError, load_yaml
from andrea_core.data.policy import Policy, load_policy, parse_policy
from andrea_core.lock import LockError, live_trainer
from andrea_core.rundir import ARCHIVE, POLICY_YAML, RUN_YAML, SAMPLES, STATE, RunDir

PHASE_RE = re.compile(r"^phase_(\d{3,})_step_(\d{6,})$")
PIVOT_JSON = "pivot.json"  # a pivot under way (record_pivot); absent when none is
PIVOT_FORMAT = 1
# The journal's steps, in order (andrea_core.pivoting): each is written once it is reached.
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


def boundary_after(step: int, every: int) -> int:
    """The pivot point for a pivot decided at `step`: the next checkpoint on the grid (or this one)."""
    return step if step % every == 0 else (step // every + 1) * every


def parse_policy_text(text: str, source: str) -> Policy:
    """Validate a policy before anything is touched: a bad one must not half-pivot a run."""
    return parse_policy(load_yaml(text, source), source)


def phases(run: RunDir) -> list[tuple[int, int]]:
    """(phase number, boundary step) of every closed phase, oldest first."""
    found = (PHASE_RE.match(n) for n in run.listdir(ARCHIVE))
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


@dataclass
class PivotCheck:
    policy: Policy
    text: str  # the policy's exact YAML, installed verbatim
    source: str  # the name or path it was given as
    max_steps: int  # what the resumed trainer trains to (the run config's when not given)
    device: str  # the device the resumed trainer will use, resolved here


def check_pivot(
    run: RunDir,
    policy: str,
    *,
    max_steps: int | None = None,
    device: str = "auto",
    restart: bool = True,
    warn: Callable[[str], None] = print,
) -> PivotCheck:
    """Every check of a pivot made before anything is touched: the run exists; the new policy parses,
    is feasible and passes the trainer's own data check on this machine (pipeline.prepare_data: arms
    with data, enough tokens, caps and floors of the arms left); and, for a restart, the device exists
    here and max_steps lies beyond where the run already is (require_steps_after checks it again once
    the pivot point is known)."""
    from andrea_core.data.pipeline import prepare_data  # the data package imports this module
    from andrea_core.data.tokens import run_tokenizer
    from andrea_core.runs import read_run

    if not run.exists(RUN_YAML):
        raise ConfigError(f"{run.url}: no run here (no {RUN_YAML}): nothing to pivot")
    cfg = read_run(run).config
    parsed, text = load_policy(policy)
    prepare_data(parsed, cfg, run_tokenizer(run, cfg), warn)
    target = max_steps if max_steps is not None else cfg.train.max_steps
    resolved = device
    if restart:
        from andrea_core.trainer import pick_device  # imports torch and the trainer: only here

        resolved = pick_device(device)
        journal = read_pivot(run) or {}
        if journal.get("boundary") is not None:  # a rerun: the resumed trainer may be past it already
            require_steps_after(target, journal["boundary"], "the pivot point of the pivot under way")
        else:
            steps = run.checkpoint_steps()
            require_steps_after(target, steps[-1] if steps else 0, "the run's newest checkpoint")
    return PivotCheck(parsed, text, policy, target, resolved)


def require_steps_after(max_steps: int, step: int, what: str = "the pivot point") -> None:
    """A resumed trainer with nothing to train would end at once and never confirm the pivot."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= step:
        raise ConfigError(
            f"max_steps {max_steps!r} is not beyond {what} (step {step}): the resumed trainer would have "
            "nothing to train; pass a larger max_steps"
        )


def record_pivot(
    run: RunDir,
    policy: Policy,
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
    pivot journal's fields (andrea_core.pivoting); those of an earlier record of the same pivot (same
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
    """The pivot under way, or None. An unreadable file is reported as one that protects everything."""
    if not run.exists(PIVOT_JSON):
        return None
    try:
        doc = run.read_json(PIVOT_JSON)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        for key in ("boundary", "not_before"):
            if doc.get(key) is not None:
                doc[key] = int(doc[key])
        return doc
    except (ValueError, TypeError) as e:
        return {"unreadable": f"{run.path(PIVOT_JSON)}: {type(e).__name__}"}


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


@dataclass
class ArchivedPhase:
    folder: str
    moved: list[str]


def next_phase_folder(run: RunDir, boundary: int) -> str:
    number = (phases(run)[-1][0] if phases(run) else 0) + 1
    return f"{ARCHIVE}/phase_{number:03d}_step_{boundary:06d}"


def archive_phase(
    run: RunDir,
    boundary: int,
    folder: str | None = None,
    after_move: Callable[[str], None] | None = None,
) -> ArchivedPhase:
    """Close the phase that ended at `boundary`: move its policy-scoped sidecars, its policy and any
    checkpoint newer than the boundary into archive/phase_NNN_step_SSSSSS/. `.loss.json` stays put.

    Idempotent for one `folder` (the pivot journal records it before the first move): a rerun after a
    crash between two moves moves what is left into the same folder, never into a second one.
    `after_move(name)` is called after each move (the journal's test hook)."""
    holder = live_trainer(run)
    if holder is not None:
        raise LockError(f"{run.url}: trainer pid {holder.pid} is still running; stop it before archiving")
    run.read_checkpoint(boundary)  # raises CheckpointError if the pivot point is missing or bad
    folder = folder or next_phase_folder(run, boundary)
    number = int(PHASE_RE.match(folder.rsplit("/", 1)[-1]).group(1))
    run.makedirs(folder)
    moved = []

    def move(name: str) -> None:
        target = f"{folder}/{name}"
        if run.exists(target) and run.read_bytes(target) == run.read_bytes(name):
            run.remove(name)  # an object store's move copied, then died before the delete
        else:
            run.move(name, target)
        moved.append(name)
        if after_move is not None:
            after_move(name)

    for name in (SAMPLES, STATE):
        if run.exists(name):
            move(name)
    # The policy is copied, not moved: the run directory is never without one, even mid-pivot.
    if run.exists(POLICY_YAML) and not run.exists(f"{folder}/{POLICY_YAML}"):
        run.write_atomic(f"{folder}/{POLICY_YAML}", run.read_bytes(POLICY_YAML))
        moved.append(POLICY_YAML)
    # The closed phase's tail (e.g. the checkpoint SIGTERM wrote): a crash right after the pivot must
    # resume from the boundary under the new policy, never from the old phase.
    for step in run.checkpoint_steps():
        if step > boundary:
            move(checkpoint_name(step))
    if not run.exists(f"{folder}/phase.json"):
        run.write_json(
            f"{folder}/phase.json", {"phase": number, "boundary": boundary, "closed_at": time.time()}
        )
    return ArchivedPhase(folder, moved)


def install_policy(run: RunDir, policy_text: str, source: str = "new policy") -> Policy:
    policy = parse_policy_text(policy_text, source)
    run.write_text(POLICY_YAML, policy_text)
    return policy


def pivot_run_directory(run: RunDir, boundary: int, policy_text: str) -> ArchivedPhase:
    """Steps 3-5 in one call for a stopped run: validate, archive, install."""
    parse_policy_text(policy_text, "new policy")
    if boundary not in run.checkpoint_steps():
        raise CheckpointError(run.path(checkpoint_name(boundary)), "pivot checkpoint not on disk")
    archived = archive_phase(run, boundary)
    install_policy(run, policy_text)
    return archived
