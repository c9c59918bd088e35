"""Checkpoint retention: which step_NNNNNN.bin files a run keeps, and deleting the rest safely.

A 200K-step run that checkpoints every 100 steps writes 2,000 checkpoints (nearly 3 TB at 120M
parameters). A checkpoint stays if it is
  - one of the `keep_last` newest (recent recovery points),
  - a multiple of `keep_every` (long-range recovery and comparison points),
  - a pivot boundary (its archive/phase_NNN_step_SSSSSS folder names it): where a phase starts,
  - the checkpoint of a pivot under way (pivot.json, written before the pivot stops the trainer),
  - a fork point: a step in forks.jsonl, or for a branch the parent_step its lineage records,
  - newer than the newest valid checkpoint (a bad file is evidence; it is never deleted here),
  - the divergence guard's rollback point: the newest checkpoint at least `rollback_reach` steps before
    the step after the newest (train.guard.rollback_margin plus the steps a divergence may have begun
    before it is detected: `rollback_reach`), and every checkpoint newer than that, which may still
    become it: a rollback goes where it would had every checkpoint been kept.
Nothing is deleted before the newest checkpoint has been read back and validated, so that no run is
ever left with only a broken checkpoint. Only top-level checkpoints are considered: archive/ and
refused/ are never touched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from andrea_core.checkpoint import CheckpointError, checkpoint_name
from andrea_core.config import GuardConfig, RetentionConfig
from andrea_core.run.lineage import fork_records, phases
from andrea_core.run.pivot_journal import pivot_protected_steps
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir


@dataclass
class RetentionPlan:
    newest: int | None  # the newest valid checkpoint: nothing at or above it is ever deleted
    keep: dict[int, list[str]] = field(default_factory=dict)  # step -> why it stays
    delete: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)  # what was actually removed


def protected_steps(run: RunDir, steps: list[int] | None = None) -> dict[int, list[str]]:
    """Checkpoints that retention never deletes, with the reason: pivot boundaries and fork points.
    `steps`: the checkpoints the caller listed and plans over (a pass deletes only among those), else
    listed here."""
    protected: dict[int, list[str]] = defaultdict(list)
    for number, boundary in phases(run):
        protected[boundary].append(f"pivot boundary (phase {number})")
    for record in fork_records(run):
        protected[int(record["step"])].append(f"fork point ({', '.join(record.get('names', []))})")
    listed = run.checkpoint_steps() if steps is None else steps
    for step, why in pivot_protected_steps(run, listed).items():
        protected[step].append(why)
    try:
        lineage = read_run(run).lineage
    except FileNotFoundError:  # none (the run's folder not even there)
        lineage = {}
    if lineage.get("parent_step") is not None:
        protected[int(lineage["parent_step"])].append(f"forked from {lineage.get('parent')}")
    return dict(protected)


def rollback_reach(guard: GuardConfig) -> int | None:
    """How far before the step after the newest checkpoint the guard's rollback point must be: its
    margin, plus the steps a divergence may have begun before it is detected (a spike's `consecutive`,
    a rise's `rise_steps`); None with the guard off."""
    if not guard.enabled:
        return None
    return guard.rollback_margin + max(guard.consecutive, guard.rise_steps) - 1


def run_reach(run: RunDir, guard: GuardConfig | None = None) -> int | None:
    """rollback_reach of `guard`, or where none is given of the run's run.yaml (None without one: no
    guard to keep a rollback point for)."""
    if guard is not None:
        return rollback_reach(guard)
    try:
        return rollback_reach(read_run(run).config.train.guard)
    except FileNotFoundError:
        return None


def plan_retention(
    steps: list[int],
    cfg: RetentionConfig,
    protected: dict[int, list[str]],
    newest: int,
    reach: int | None = None,
) -> RetentionPlan:
    """Pure: which of `steps` stay and which go, given the newest valid checkpoint `newest`; `reach`
    (rollback_reach): the guard's rollback point, and every newer checkpoint, are kept too."""
    keep: dict[int, list[str]] = defaultdict(list)
    older = [s for s in steps if s <= newest]
    if cfg.keep_last is None:
        for s in older:
            keep[s].append("keep_last is null (keep all)")
    else:
        for s in older[-cfg.keep_last :]:
            keep[s].append(f"one of the newest {cfg.keep_last}")
    for s in steps:
        if cfg.keep_every and s % cfg.keep_every == 0:
            keep[s].append(f"multiple of keep_every {cfg.keep_every}")
        if s in protected:
            keep[s].extend(protected[s])
        if s > newest:
            keep[s].append("newer than the newest valid checkpoint (kept as evidence)")
    if reach is not None:
        # The rollback point, and every checkpoint that may still become it: what the guard would roll
        # back to is then what it would be had every checkpoint been kept (docs/design.md "A rollback
        # point always exists"). Reasons are named only where they are what keeps a checkpoint.
        bound = newest + 1 - reach
        far = [s for s in older if s <= bound]
        if far and far[-1] not in keep:
            keep[far[-1]].append(f"the guard's rollback point (at least {reach} steps back)")
        for s in older:
            if s > bound and s not in keep:
                keep[s].append(f"may become the guard's rollback point (within {reach} steps)")
    return RetentionPlan(
        newest, {s: keep[s] for s in steps if s in keep}, [s for s in steps if s not in keep]
    )


def apply_retention(
    run: RunDir,
    cfg: RetentionConfig,
    n_params: int | None,
    log: Callable[[str], None] = print,
    newest: int | None = None,
    dry_run: bool = False,
    guard: GuardConfig | None = None,
) -> RetentionPlan:
    """Plan retention and (unless `dry_run`) delete what it releases. `newest`: the checkpoint just
    written (the trainer's case), read back before anything is deleted; None finds and validates the
    newest valid one (the `andrea gc` case). `guard`: the run's guard settings where the caller holds
    them (the trainer: its frozen run.yaml, read once at its start); None reads them from run.yaml."""
    steps = run.checkpoint_steps()
    reach = run_reach(run, guard)
    if newest is None:
        ckpt = run.newest_valid_checkpoint(n_params, warn=log)
        if ckpt is None:
            return RetentionPlan(None, {s: ["no valid checkpoint: nothing is deleted"] for s in steps})
        newest = ckpt.step
    elif not dry_run:
        # The trainer's pass, after each checkpoint. The rules alone (no file read) say whether anything
        # may go; if so, the newest is read back before anything is deleted, and only then are the
        # protections read, right before the deletes, not a read-back (seconds for a large checkpoint
        # on an object store) before them: a fork records its step in forks.jsonl and then checks it
        # is still here, so the shorter that time, the fewer records a pass can miss
        # (ops.fork.confirm_fork_point waits out the rest).
        rules = plan_retention(steps, cfg, {}, newest, reach)
        if not rules.delete:
            return rules
        try:
            run.read_checkpoint(newest, n_params)
        except CheckpointError as e:
            log(f"warning: retention deletes nothing: the newest checkpoint does not read back valid ({e})")
            why = ["kept: the newest checkpoint does not read back valid"]
            return RetentionPlan(newest, {s: rules.keep.get(s, why) for s in steps}, [])
    plan = plan_retention(steps, cfg, protected_steps(run, steps), newest, reach)
    if dry_run or not plan.delete:
        return plan
    for step in plan.delete:
        try:
            run.remove(checkpoint_name(step))
        except FileNotFoundError:
            continue  # someone else's retention got there first
        plan.deleted.append(step)
    if plan.deleted:
        log(f"retention: deleted {', '.join(checkpoint_name(s) for s in plan.deleted)}")
    return plan


def format_plan(plan: RetentionPlan, dry_run: bool) -> str:
    verb = "would delete" if dry_run else "deleted"
    rows = [(s, "keep", "; ".join(why)) for s, why in plan.keep.items()]
    rows += [(s, verb if dry_run or s in plan.deleted else "not found", "") for s in plan.delete]
    lines = [f"  {checkpoint_name(s)}  {what:<12}  {why}".rstrip() for s, what, why in sorted(rows)]
    gone = len(plan.delete) if dry_run else len(plan.deleted)
    lines.append(f"{len(plan.keep)} kept, {gone} {verb}")
    return "\n".join(lines)
