"""The polish pivot's run-directory steps (DESIGN.md "Pivot sequence", steps 3 to 5).

Stopping and starting the trainer belongs to whoever orchestrates (Prefect's `pivot` flow, or an
operator in a shell); this module only rearranges the run directory, and only while no trainer runs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from andrea_core.checkpoint import CheckpointError, checkpoint_name
from andrea_core.config import load_yaml
from andrea_core.data.policy import Policy, parse_policy
from andrea_core.lock import LockError, live_trainer
from andrea_core.rundir import ARCHIVE, POLICY_YAML, SAMPLES, STATE, RunDir

PHASE_RE = re.compile(r"^phase_(\d{3,})_step_(\d{6,})$")


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
class ArchivedPhase:
    folder: str
    moved: list[str]


def archive_phase(run: RunDir, boundary: int) -> ArchivedPhase:
    """Close the phase that ended at `boundary`: move its policy-scoped sidecars, its policy and any
    checkpoint newer than the boundary into archive/phase_NNN_step_SSSSSS/. `.loss.json` stays put."""
    holder = live_trainer(run)
    if holder is not None:
        raise LockError(f"{run.url}: trainer pid {holder.pid} is still running; stop it before archiving")
    run.read_checkpoint(boundary)  # raises CheckpointError if the pivot point is missing or bad
    number = (phases(run)[-1][0] if phases(run) else 0) + 1
    folder = f"{ARCHIVE}/phase_{number:03d}_step_{boundary:06d}"
    run.makedirs(folder)
    moved = []
    for name in (SAMPLES, STATE):
        if run.exists(name):
            run.move(name, f"{folder}/{name}")
            moved.append(name)
    # The policy is copied, not moved: the run directory is never without one, even mid-pivot.
    if run.exists(POLICY_YAML):
        run.write_atomic(f"{folder}/{POLICY_YAML}", run.read_bytes(POLICY_YAML))
        moved.append(POLICY_YAML)
    # The closed phase's tail (e.g. the checkpoint SIGTERM wrote): a crash right after the pivot must
    # resume from the boundary under the new policy, never from the old phase.
    for step in run.checkpoint_steps():
        if step > boundary:
            run.move(checkpoint_name(step), f"{folder}/{checkpoint_name(step)}")
            moved.append(checkpoint_name(step))
    run.write_json(f"{folder}/phase.json", {"phase": number, "boundary": boundary, "closed_at": time.time()})
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
