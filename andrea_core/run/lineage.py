"""A run's family tree: its phases (closed at pivots, archive/phase_NNN_step_SSSSSS/) and the audit forks
made from it (forks.jsonl), each read here once, and the tree of both, recursively (`andrea lineage`).

Built from the run directories alone (each branch's run.yaml lineage too), so that it works from any
machine that can reach the run. Takes a RunDir or a URL; retention, the trainer and the pivot read
phases and fork points from here. A branch's name and replicate fields are read through
branch_of, which checks them as a fork writes them (a forged run.yaml is refused naming the field).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from andrea_core.checkpoint import Checkpoint, checkpoint_name
from andrea_core.config import ConfigError, load_yaml
from andrea_core.document import Field, check
from andrea_core.run.loss_log import well_formed_lines
from andrea_core.run.record import read_run
from andrea_core.run.rundir import (
    ARCHIVE,
    FORKS,
    POLICY_YAML,
    RUN_YAML,
    ProtocolNotAllowed,
    RunDir,
)

# Like an arm name: it becomes part of a path, so letters, digits, "-", "_" and "." (not leading) only.
BRANCH_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # fullmatch: no trailing newline


def check_branch_name(name: Any, where: str = "branch") -> str:
    if not isinstance(name, str) or not BRANCH_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"{where}: name {name!r} is not allowed: use letters, digits, '-', '_' and '.' (not first), "
            "at most 100 characters (it becomes part of the branch's path)"
        )
    return name


@dataclass(frozen=True)
class BranchOf:
    """What a branch's run.yaml lineage says it is: its branch's name and which replicate it is."""

    name: str | None  # None: no lineage.branch (a run forked before names were recorded)
    replicate: int = 0
    replicates: int = 1


def branch_of(run: RunDir, lineage: dict | None = None) -> BranchOf:
    """The branch name and replicate of `run` (its run.yaml's lineage, or `lineage` already read),
    each checked as a fork writes it: a name that could not have been a branch name, or replicate
    fields out of range, are refused naming run.yaml and the field (each field's type and bounds:
    record.LINEAGE_SCHEMA, checked as read_run reads it)."""
    lineage = read_run(run).lineage if lineage is None else lineage
    where = run.path(RUN_YAML)
    name = lineage.get("branch")
    if name is not None:
        check_branch_name(name, f"{where}: lineage.branch")
    replicates = lineage.get("replicates", 1)
    replicate = lineage.get("replicate", 0)
    if replicate >= replicates:
        raise ConfigError(f"{where}: lineage.replicate: expected 0..{replicates - 1}, got {replicate!r}")
    return BranchOf(name, replicate, replicates)


@dataclass
class Branch:
    name: str | None
    url: str
    run: Lineage | None  # None: the branch could not be read (see `problem`)
    problem: str | None = None


@dataclass
class Fork:
    step: int
    time: float | None
    branches: list[Branch]


@dataclass
class Phase:
    number: int
    start: int  # the step the phase started from
    end: int | None  # its pivot boundary; None for the phase in force
    policy: str | None
    folder: str | None  # a closed phase's archive folder
    closed_at: float | None = None
    forks: list[Fork] = field(default_factory=list)


@dataclass
class Lineage:
    url: str
    parent: str | None
    parent_step: int | None
    branch: str | None
    overrides: dict  # a branch's config changes from its parent
    newest_checkpoint: int | None
    phases: list[Phase]

    def to_dict(self) -> dict:
        return asdict(self)


def _policy_name(run: RunDir, name: str) -> str | None:
    try:
        doc = load_yaml(run.read_bounded(name).decode(errors="replace"), run.path(name))
    except (FileNotFoundError, ConfigError):
        return None
    return doc.get("name") if isinstance(doc, dict) else None


def read_lineage(url: str, _seen: frozenset[str] = frozenset()) -> Lineage:
    run = RunDir(url)
    record = read_run(run)
    seen = _seen | {run.url}
    start = record.lineage.get("parent_step") or 0
    steps = run.checkpoint_steps()
    tree = []
    for number, boundary in phases(run):
        folder = phase_folder(number, boundary)
        closed = run.read_json(f"{folder}/phase.json") if run.exists(f"{folder}/phase.json") else {}
        policy = _policy_name(run, f"{folder}/{POLICY_YAML}")
        tree.append(Phase(number, start, boundary, policy, folder, closed.get("closed_at")))
        start = boundary
    tree.append(Phase(len(tree) + 1, start, None, _policy_name(run, POLICY_YAML), None))

    for record_line in fork_records(run):
        names = record_line.get("names") or [None] * len(record_line["branches"])
        branches = []
        for name, branch_url in zip(names, record_line["branches"], strict=False):
            if branch_url in seen:
                branches.append(Branch(name, branch_url, None, "cycle: already shown above"))
                continue
            try:
                branches.append(Branch(name, branch_url, read_lineage(branch_url, seen)))
            except ProtocolNotAllowed as e:  # never contacted: a forks.jsonl line is someone's input
                branches.append(Branch(name, branch_url, None, f"refused: {e}"))
            except FileNotFoundError:
                branches.append(Branch(name, branch_url, None, "missing: no run.yaml there"))
            except ConfigError as e:
                branches.append(Branch(name, branch_url, None, f"unreadable: {e}"))
        fork = Fork(int(record_line["step"]), record_line.get("time"), branches)
        _phase_of(tree, fork).forks.append(fork)

    return Lineage(
        run.url,
        record.lineage.get("parent"),
        record.lineage.get("parent_step"),
        branch_of(run, record.lineage).name,
        record.lineage.get("overrides") or {},
        steps[-1] if steps else None,
        tree,
    )


def _phase_of(tree: list[Phase], fork: Fork) -> Phase:
    """The phase a fork was made in: the first one whose boundary step is past it. A fork at the
    boundary step itself can be either side of the pivot: there the wall clock decides, where both
    times are known (only there: a clock stepped back makes a later fork's time the earlier one)."""
    for phase in tree[:-1]:
        if phase.end is None or fork.step < phase.end:
            return phase
        if fork.step == phase.end:
            if fork.time is None or phase.closed_at is None or fork.time < phase.closed_at:
                return phase
    return tree[-1]


def _nodes(lin: Lineage) -> list[tuple[str, list]]:
    children = []
    for phase in lin.phases:
        end = phase.end if phase.end is not None else lin.newest_checkpoint
        span = f"steps {phase.start}..{'?' if end is None else end}"
        label = f"phase {phase.number}  {span}{' (current)' if phase.end is None else ''}"
        label += f"  policy {phase.policy or '?'}" + (f"  [{phase.folder}]" if phase.folder else "")
        forks = []
        for fork in phase.forks:
            names = ", ".join(b.name or "?" for b in fork.branches)
            branches = [
                (f"{b.url}  ({b.problem})", []) if b.run is None else _run_node(b.run) for b in fork.branches
            ]
            forks.append((f"fork at step {fork.step}: {names}", branches))
        children.append((label, forks))
    return children


def _run_node(lin: Lineage) -> tuple[str, list]:
    newest = checkpoint_name(lin.newest_checkpoint) if lin.newest_checkpoint is not None else "none"
    changes = "".join(f"  {k}={v}" for k, v in sorted(lin.overrides.items()))
    return f"{lin.url}{changes}  newest checkpoint {newest}", _nodes(lin)


def format_lineage(lin: Lineage) -> str:
    label, children = _run_node(lin)
    if lin.parent is not None:
        label += f"\n(branch {lin.branch!r} forked from {lin.parent} at step {lin.parent_step})"
    lines = [label]

    def draw(nodes: list, prefix: str) -> None:
        for i, (text, kids) in enumerate(nodes):
            last = i == len(nodes) - 1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{text}")
            draw(kids, prefix + ("    " if last else "│   "))

    draw(children, "")
    return "\n".join(lines)


PHASE_RE = re.compile(r"phase_(\d{3,})_step_(\d{6,})")  # fullmatch: no trailing newline slips in
PHASE_FOLDER_RE = re.compile(rf"{ARCHIVE}/{PHASE_RE.pattern}")  # a phase folder, run-relative


def phase_folder(number: int, boundary: int) -> str:
    """The run-relative folder of closed phase `number`, whose boundary is `boundary`."""
    return f"{ARCHIVE}/phase_{number:03d}_step_{boundary:06d}"


def phases(run: RunDir) -> list[tuple[int, int]]:
    """(phase number, boundary step) of every closed phase, oldest first."""
    found = (PHASE_RE.fullmatch(n) for n in run.listdir(ARCHIVE))
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


def require_phase_start(run: RunDir, resume: Checkpoint | None) -> None:
    """The trainer's check before it resumes `run` after a pivot: the phase in force starts at its
    boundary checkpoint, so the resume point is that checkpoint or a later one. An earlier one (the
    boundary torn or lost) would train the steps before the pivot again under the new policy."""
    closed = phases(run)
    if not closed or (resume is not None and resume.step >= closed[-1][1]):
        return
    number, boundary = closed[-1]
    found = "no valid checkpoint" if resume is None else f"only {checkpoint_name(resume.step)} before it"
    raise ConfigError(
        f"{run.url}: phase {number + 1} starts at {checkpoint_name(boundary)} (the pivot's boundary), which "
        f"is not valid (see above), and the run holds {found}: resuming there would train steps the "
        f"previous policy trained ({phase_folder(number, boundary)}) again under the new one; restore "
        f"{checkpoint_name(boundary)} from a copy and train again. Nothing was trained"
    )


def require_fork_point(run: RunDir, resume: Checkpoint | None) -> None:
    """The trainer's check before it resumes (or starts) `run`: a branch whose lineage names a fork
    point must resume from that checkpoint or a later one, never train from step 1."""
    parent_step = read_run(run).lineage.get("parent_step")
    if parent_step is None or (resume is not None and resume.step >= parent_step):
        return
    lineage = read_run(run).lineage
    found = "no valid checkpoint" if resume is None else f"only {checkpoint_name(resume.step)}"
    raise ConfigError(
        f"{run.url}: this branch of {lineage.get('parent')} was forked at step {parent_step} but holds "
        f"{found}, not a valid {checkpoint_name(parent_step)} (the fork did not finish): rerun the fork "
        f"(same step and branch names) to complete it; not training from scratch"
    )


def fork_records(run: RunDir, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The well-formed lines of the run's forks.jsonl, in order. A malformed line (torn by a crash,
    junk, the wrong shape) is skipped, and reported through `warn`, like a torn .loss.json line: it
    must not break lineage, retention or the next fork."""
    try:  # read, not exists() then read: on an object store that is a request less
        data = run.read_bounded(FORKS)
    except FileNotFoundError:  # none (the run's folder not even there)
        return []
    return well_formed_lines(data, lambda r: check(r, FORK_RECORD_SCHEMA), run.path(FORKS), warn)


def _no_lone_surrogate(text: str) -> bool:
    # JSON can escape a lone surrogate (\ud800), which no path or URL can hold.
    return not any("\ud800" <= c <= "\udfff" for c in text)


_TEXTS = Field((list,), items=Field((str,), test=_no_lone_surrogate))
FORK_RECORD_SCHEMA = {  # a forks.jsonl line
    "step": Field((int,), low=0),
    "branches": _TEXTS,
    "names": dataclasses.replace(_TEXTS, required=False),
    "time": Field((int, float), required=False, finite=False),
}
