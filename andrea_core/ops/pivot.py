"""The pivot's six steps, journaled (docs/design.md "Pivot sequence"), and their one driver, run_pivot,
for every front end: `andrea pivot` calls it in a plain shell with a detached restart; the Prefect
`pivot` flow with each step as a task (its StepRunner) and a deployment or subflow restart.

  1. take the pivot checkpoint (take_pivot_checkpoint)     4. check .loss.json byte for byte (keep_loss_log)
  2. stop the trainer (stop_trainer)                        5. install the new policy (install)
  3. archive the closed phase (archive)                     6. restart and confirm (confirm_resumed)

The journal is pivot.json (run/pivot_journal.py), held here as a PivotJournal: the pivot's intent
(policy hash, text and source, at, restart, target, boundary), its owner process and the last step
completed, rewritten atomically after each step. Each
step reads it first and skips itself if it is done, so rerunning the same pivot after a crash at any
point completes it exactly once: no second archive folder, no sidecar lost, .loss.json untouched. While
the trainer is stopped and the new policy not yet installed (pivot_journal.HALF_DONE_STEPS) a trainer refuses
to start (require_no_half_pivot); `abandon` restores the old phase instead. The journal is removed once
the pivot is complete (finish_pivot).

Also here: `check_pivot`, every check of a pivot's parameters made before anything is touched, and the
run-directory steps themselves (archive_phase, install_policy), which run only while no trainer runs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from andrea_core import faults
from andrea_core.checkpoint import CheckpointError, checkpoint_name
from andrea_core.config import REPO_ROOT, ConfigError, load_yaml
from andrea_core.data.policy import Policy, load_policy, parse_policy
from andrea_core.document import DocumentError, Field, check, check_field
from andrea_core.ops import supervise
from andrea_core.ops.supervise import LossLogSnapshot, SupervisionError
from andrea_core.run.lineage import PHASE_FOLDER_RE, phase_folder, phases
from andrea_core.run.lock import (
    ALIVE,
    REQUEST,
    UNKNOWN,
    LockError,
    TrainerIdentity,
    elsewhere_error,
    live_trainer,
    require_not_elsewhere,
    send_request,
    trainer_liveness,
)
from andrea_core.run.pivot_journal import (
    JOURNAL_SCHEMA,
    PIVOT_JSON,
    PIVOT_STEPS,
    clear_pivot,
    read_pivot,
    record_pivot,
)
from andrea_core.run.record import read_run, run_n_params
from andrea_core.run.rundir import LOCK, POLICY_YAML, RUN_YAML, SAMPLES, STATE, RunDir
from andrea_core.run.target import check_max_steps, read_target, set_target

Log = Callable[[str], None]


def _kill_point(name: str) -> None:
    """ANDREA_TEST_PIVOT_KILL_AFTER=<step name> (or archive-move-N): the pivot's process dies right
    there, as a worker killed outright would. Unset: no effect."""
    faults.die_at(faults.PIVOT_KILL_AFTER, name)


@dataclass
class PivotJournal:
    """pivot.json as the driver holds it: the pivot's intent, where it is, and what each later step
    checks against. Its format on disk, its reader and what retention reads of it are
    run/pivot_journal.py's; `from_doc` and `to_doc` are the one translation. Each step reaches its
    name with `record`, which writes the whole journal atomically before the step is taken."""

    policy: str
    policy_hash: str
    policy_text: str  # what is installed, verbatim
    source: str  # the name or path the policy was given as
    at: str  # "boundary" or "now"
    restart: str  # how the resumed trainer is started: "none", "detached", "deployment", "subflow"
    max_steps: int | None  # the target the new phase trains to
    target_before: int | None = None  # the target in force when the pivot began (abandon restores it)
    train_options: dict | None = None  # the stopped trainer's options (command.train_options)
    loss_before: LossLogSnapshot | None = None  # .loss.json when the pivot began
    step: str | None = None  # the last step reached (PIVOT_STEPS); None: not written yet
    boundary: int | None = None  # the pivot point
    not_before: int | None = None  # at="now" before its checkpoint is known: keep every one from here
    archive: str | None = None  # the closed phase's folder, named before the first move
    loss_at_stop: LossLogSnapshot | None = None  # .loss.json once the trainer had stopped
    stopped_pid: int | None = None
    stopped_step: int | None = None
    owner: dict | None = None  # the pivot's own process (pid, host, boot, start): abandon waits for it
    request_id: str | None = None  # the request's id, if it was given one (PivotCheck.request_id)

    def reached(self, step: str) -> bool:
        """Whether the last step reached is `step` or a later one."""
        return self.step in PIVOT_STEPS and PIVOT_STEPS.index(self.step) >= PIVOT_STEPS.index(step)

    def record(self, run: RunDir, step: str, **changes: Any) -> None:
        """Reach `step`, with `changes` to the journal's fields, and write pivot.json whole."""
        for name, value in changes.items():
            if name not in _JOURNAL_FIELDS:
                raise AttributeError(f"the pivot journal has no field {name!r}")
            setattr(self, name, value)
        self.step = step
        policy = _PolicyId(self.policy, self.policy_hash)
        record_pivot(run, policy, step, self.boundary, self.not_before, **self.to_doc())

    def to_doc(self) -> dict[str, Any]:
        """The fields pivot.json holds besides record_pivot's own (policy, hash, step, boundary...)."""
        core = ("policy", "policy_hash", "step", "boundary", "not_before")
        doc = {f: getattr(self, f) for f in _JOURNAL_FIELDS if f not in core}
        for name in ("loss_before", "loss_at_stop"):
            mark = doc[name]
            doc[name] = (
                None
                if mark is None
                else {"size": mark.size, "sha256": mark.sha256, "segments": mark.segments}
            )
        return doc

    @classmethod
    def from_doc(cls, run: RunDir, doc: dict[str, Any]) -> PivotJournal:
        """The journal of read_pivot's document (already checked field by field there); the fields
        it does not check are checked here. A forged or damaged one is refused by name."""
        where = run.path(PIVOT_JSON)
        fields = {f: doc.get(f) for f in _JOURNAL_FIELDS}
        try:
            check(fields, DRIVER_SCHEMA)
        except DocumentError as e:
            raise ConfigError(f"{where}: {e}") from None
        for name in ("loss_before", "loss_at_stop"):
            mark = fields[name]
            fields[name] = mark and LossLogSnapshot(mark["size"], mark["sha256"], mark.get("segments", []))
        for name in ("policy", "policy_hash", "source", "at", "restart"):
            fields[name] = fields[name] or ""  # text or null (read_pivot's JOURNAL_SCHEMA)
        if fields["policy_text"] is None:
            raise ConfigError(
                f"{where}: the pivot to {fields['policy']!r} under way records no policy_text, so it "
                f"cannot be resumed; abandon it (andrea pivot {run.url} --abandon) first"
            )
        return cls(**fields)


_JOURNAL_FIELDS = tuple(f.name for f in dataclasses.fields(PivotJournal))


@dataclass(frozen=True)
class _PolicyId:
    name: str
    hash: str


# The driver's fields of pivot.json (record_pivot's own: pivot_journal.JOURNAL_SCHEMA), and the owner
# process it records: checked once, by name, before the journal is trusted (document.py).
_WHOLE = Field((int,), null=True, required=False, low=0, says="is not a whole number")
_OBJECT = Field((dict,), null=True, required=False, kind="an object")
LOSS_MARK_SCHEMA = {  # a record of .loss.json's bytes
    "size": Field((int,), low=0),
    "sha256": Field((str,), kind="text"),
    "segments": Field((list,), required=False),
}
OWNER_SCHEMA = {  # the pivot's own process: TrainerIdentity's fields, as the lock declares them
    "pid": Field((int,), low=1, high=2**22),
    "host": Field((str,), high=255, printable=True),
    "boot_id": Field((str,), high=255, printable=True),
    "proc_start": Field((int,), null=True, required=False, low=0),
    "pid_ns": Field((str,), null=True, required=False, high=255, printable=True),
}
DRIVER_SCHEMA = {
    **dict.fromkeys(("stopped_pid", "stopped_step", "target_before"), _WHOLE),
    "train_options": _OBJECT,
    "owner": _OBJECT,
    **dict.fromkeys(("loss_before", "loss_at_stop"), replace(_OBJECT, fields=LOSS_MARK_SCHEMA)),
}


def _this_process() -> dict:
    """This process's identity as the journal's `owner` records it."""
    me = TrainerIdentity.of_this_process("")
    return {
        "pid": me.pid,
        "host": me.host,
        "boot_id": me.boot_id,
        "proc_start": me.proc_start,
        "pid_ns": me.pid_ns,
    }


def owner_alive(journal: PivotJournal | dict) -> int | None:
    """The pid of the pivot process that wrote the journal if it still runs, as checked here (same
    boot, pid namespace and start time); None if it is gone or cannot be checked from here."""
    owner = journal.owner if isinstance(journal, PivotJournal) else journal.get("owner")
    try:
        check(owner, OWNER_SCHEMA)
    except DocumentError:
        return None  # none recorded, or not one our writer writes: no process to wait for
    ident = TrainerIdentity(
        owner["pid"], owner["host"], owner["boot_id"], owner.get("proc_start"), 0.0, "", owner.get("pid_ns")
    )
    if ident.pid == os.getpid() and ident.liveness()[0] == ALIVE:
        return None  # this very process: a rerun in the same process (a flow retried in place)
    return ident.pid if ident.liveness()[0] == ALIVE else None


# --- the checks before anything is touched, and the run directory's steps ----------------------


def boundary_after(step: int, every: int) -> int:
    """The pivot point for a pivot decided at `step`: the next checkpoint on the grid (or this one)."""
    return step if step % every == 0 else (step // every + 1) * every


def parse_policy_text(text: str, source: str) -> Policy:
    """Validate a policy before anything is touched: a bad one must not half-pivot a run."""
    return parse_policy(load_yaml(text, source), source)


@dataclass
class PivotCheck:
    policy: Policy
    text: str  # the policy's exact YAML, installed verbatim
    source: str  # the name or path it was given as
    max_steps: int  # what the resumed trainer trains to (the run's newest target when not given)
    device: str  # the device the resumed trainer will use, resolved here
    # The resumed trainer's options (command.train_options): the stopped trainer's, as its lock
    # recorded them, with --device replaced where the pivot was given one and --max-steps the target.
    train: dict | None = None
    # The request's id (`--request-id`): a rerun with it finds its pivot done, however much happened
    # since; a pivot with another id is a new request, to the policy in force too (already_pivoted).
    request_id: str | None = None


def check_pivot(
    run: RunDir,
    policy: str,
    *,
    max_steps: int | None = None,
    device: str | None = None,
    restart: bool = True,
    warn: Callable[[str], None] = print,
    request_id: str | None = None,
) -> PivotCheck:
    """Every check of a pivot made before anything is touched: the run exists; the new policy parses,
    is feasible and passes the trainer's own data check on this machine (pipeline.prepare_data: arms
    with data, enough tokens, caps and floors of the arms left), with every arm's data here
    (require_available: never a pivot that would train without one of its arms); and, for a restart,
    the device exists here and max_steps lies beyond where the run already is (require_steps_after
    checks it again once the pivot point is known)."""
    from andrea_core.data.pipeline import prepare_data, require_available  # data imports this module
    from andrea_core.data.tokens import run_tokenizer

    try:
        check_field("--request-id", request_id, JOURNAL_SCHEMA["request_id"])
    except DocumentError as e:
        raise ConfigError(f"{e} (1 to 64 of A-Z a-z 0-9 . _ : -, starting with a letter or digit)") from None
    if not run.exists(RUN_YAML):
        raise ConfigError(f"{run.url}: no run here (no {RUN_YAML}): nothing to pivot")
    cfg = read_run(run).config
    parsed, text = load_policy(policy)
    train = recorded_train_options(run)
    if device is not None:
        train["device"] = device
    # The pivot's --max-steps, else the run's newest target (target.jsonl, else run.yaml's): never the
    # stopped trainer's own --max-steps, which a later target (an earlier pivot's) has replaced.
    if max_steps is not None:
        target = check_max_steps(max_steps)
    else:
        target = read_target(run, cfg.train.max_steps).max_steps
    train["max_steps"] = target
    resolved = train["device"]
    if restart:  # before the data check, which may tokenize new arms for minutes
        from andrea_core.model.device import pick_device  # imports torch and the trainer: only here

        resolved = pick_device(train["device"])
        journal = read_pivot(run) or {}
        if journal.get("boundary") is not None:  # a rerun: the resumed trainer may be past it already
            require_steps_after(target, journal["boundary"], "the pivot point of the pivot under way")
        else:
            steps = run.checkpoint_steps()
            require_steps_after(target, steps[-1] if steps else 0, "the run's newest checkpoint")
    _, unavailable, _ = prepare_data(parsed, cfg, run_tokenizer(run, cfg), warn)
    require_available(parsed, unavailable, "a pivot")
    return PivotCheck(parsed, text, policy, target, resolved, train, request_id)


def recorded_train_options(run: RunDir) -> dict:
    """The options of the run's last trainer (its lock, live or released: `train_args`), parsed and
    checked (command.train_options); the defaults where none were recorded. A lock is someone else's
    input: options that do not parse are refused by name, never run, and its number of ranks is never
    taken (a world size is the operator's choice: the restart takes the stopped job's own WORLD_SIZE,
    read from the process the pivot verified and signalled, and cmd_train bounds it by the devices)."""
    from andrea_core.command import train_options
    from andrea_core.run.lock import read_lock

    held = read_lock(run)
    args = held.train_args if held is not None and held.train_args is not None else []
    try:
        options = train_options(args)
    except ValueError as e:
        raise ConfigError(
            f"{run.path(LOCK)}: the trainer's recorded command line cannot be restarted ({e}); "
            "pass --no-restart and start the trainer yourself"
        ) from None
    options["nproc_per_node"] = 1
    return options


def require_steps_after(max_steps: int, step: int, what: str = "the pivot point") -> None:
    """A resumed trainer with nothing to train would end at once and never confirm the pivot."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= step:
        raise ConfigError(
            f"max_steps {max_steps!r} is not beyond {what} (step {step}): the resumed trainer would have "
            "nothing to train; pass a larger max_steps"
        )


@dataclass
class ArchivedPhase:
    folder: str
    moved: list[str]


def next_phase_folder(run: RunDir, boundary: int) -> str:
    return phase_folder((phases(run)[-1][0] if phases(run) else 0) + 1, boundary)


def archive_phase(
    run: RunDir,
    boundary: int,
    folder: str | None = None,
    after_move: Callable[[str], None] | None = None,
    closed_by: dict | None = None,
) -> ArchivedPhase:
    """Close the phase that ended at `boundary`: move its policy-scoped sidecars, its policy and any
    checkpoint newer than the boundary into archive/phase_NNN_step_SSSSSS/. `.loss.json` stays put.

    Idempotent for one `folder` (the pivot journal records it before the first move): a rerun after a
    crash between two moves moves what is left into the same folder, never into a second one.
    `after_move(name)` is called after each move (the journal's test hook). `closed_by`: what
    phase.json records of the pivot that closes the phase (the policy it installs, its request id)."""
    verdict = require_not_elsewhere(run, "archiving the phase")
    holder = verdict.holder
    if verdict.state == ALIVE:
        raise LockError(f"{run.url}: trainer pid {holder.pid} is still running; stop it before archiving")
    run.read_checkpoint(boundary)  # raises CheckpointError if the pivot point is missing or bad
    folder = folder or next_phase_folder(run, boundary)
    m = PHASE_FOLDER_RE.fullmatch(folder)
    if m is None:  # read_pivot checks the journal's; this is every caller's
        raise ConfigError(f"{run.url}: {folder!r} is not a phase folder of this run")
    number = int(m.group(1))
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
        closed = {"phase": number, "boundary": boundary, "closed_at": time.time(), **(closed_by or {})}
        run.write_json(f"{folder}/phase.json", closed)
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


# --- starting or resuming a pivot ----------------------------------------------------------------


def begin_pivot(run: RunDir, checked: PivotCheck, at: str, restart: str, log: Log = print) -> PivotJournal:
    """The journal of this pivot: the one a crash left (same policy: resumed from its last step), or a
    new one, not yet written (take_pivot_checkpoint writes it with the pivot point). A journal of
    another pivot is refused (one pivot at a time), and so is one whose pivot process still runs."""
    if at not in ("boundary", "now"):
        raise ConfigError(f"--at {at!r}: expected boundary or now")
    doc = read_pivot(run)
    if doc is not None and "unreadable" in doc:
        raise ConfigError(f"{doc['unreadable']}: the pivot journal is unreadable; not pivoting")
    if doc is None:
        return PivotJournal(
            policy=checked.policy.name,
            policy_hash=checked.policy.hash,
            policy_text=checked.text,
            source=checked.source,
            at=at,
            restart=restart,
            max_steps=checked.max_steps,
            target_before=read_target(run, read_run(run).config.train.max_steps).max_steps,
            train_options=checked.train,
            loss_before=LossLogSnapshot.take(run),
            owner=_this_process(),
            request_id=checked.request_id,
        )
    if doc.get("policy_hash") != checked.policy.hash:
        raise ConfigError(
            f"{run.path(PIVOT_JSON)}: a pivot to policy {doc.get('policy')!r} (hash "
            f"{doc.get('policy_hash')}) is under way, not to {checked.policy.name!r}: finish it "
            f"(rerun it with --policy {doc.get('source') or doc.get('policy')}) or abandon it "
            f"(andrea pivot {run.url} --abandon) first"
        )
    journal = PivotJournal.from_doc(run, doc)
    if checked.request_id not in (None, journal.request_id):  # without one: a rerun of the journal's
        again = f"--request-id {journal.request_id}" if journal.request_id else "no --request-id"
        raise ConfigError(
            f"{run.path(PIVOT_JSON)}: the pivot under way is request {journal.request_id!r}, not "
            f"{checked.request_id!r}: finish it (rerun it with {again}) or abandon it "
            f"(andrea pivot {run.url} --abandon) first; not pivoting"
        )
    if (pid := owner_alive(journal)) is not None:
        raise LockError(
            f"{run.path(PIVOT_JSON)}: the pivot to {journal.policy!r} is being run by process {pid}, which "
            f"still runs (step {journal.step!r}): let it finish; not pivoting"
        )
    # The journal's policy text is what would be installed: re-validated and re-hashed here, so a
    # journal whose recorded hash is the operator's policy's but whose text is not is refused.
    recorded = parse_policy_text(journal.policy_text, f"{run.path(PIVOT_JSON)}: policy_text")
    if recorded.hash != journal.policy_hash:
        raise ConfigError(
            f"{run.path(PIVOT_JSON)}: its policy_text hashes to {recorded.hash}, not to the policy_hash "
            f"{journal.policy_hash} it records: a forged or damaged journal; not pivoting "
            "(inspect it, then remove it)"
        )
    log(f"resuming the pivot to {checked.policy.name!r} after step {journal.step!r} (pivot.json)")
    journal.owner = _this_process()  # recorded with its next step
    return journal


def already_pivoted(run: RunDir, checked: PivotCheck, restart: bool, log: Log = print) -> dict | None:
    """A completed pivot that this request is (no journal): the result it had, else None. With a request
    id, the closed phase whose phase.json records that id (another policy than its: ConfigError), and
    none: a new request, to the policy in force too. Without one, a pivot to the policy in force in a run
    where a pivot closed a phase. A pivot killed after it completed but before it exited, or a flow run
    rerun, is that pivot again, however far the new phase has trained since: pivoting again would close
    a second phase folder for one request (the chaos soak's fault 121, seed 1, 2026-12-04, with nothing
    trained since; fault 363, 2026-12-06, 15 steps into the new phase). Asked to restart with no
    trainer holding the run, it refuses (ConfigError) saying how to start one, rather than pivot again."""
    done = _completed_pivot(run, checked)
    if done is None:
        return None
    holder = _holder(run)
    if holder is not None:
        done["trainer"] = {"pid": holder.pid, "host": holder.host}
    if restart and holder is None:
        raise ConfigError(
            f"{run.url}: {done['what']} and no trainer is running: start one "
            f"(andrea train --run-dir {run.url}); not pivoting again"
        )
    since = f"; its phase has trained {done['trained_since']} steps since" if done["trained_since"] else ""
    log(f"{done['what']}{since}; nothing to do")
    return done


def _completed_pivot(run: RunDir, checked: PivotCheck) -> dict | None:
    from andrea_core.data.policy import read_policy

    closed = phases(run)
    if not closed or read_pivot(run) is not None:
        return None
    name, request = checked.policy.name, checked.request_id
    if request is not None:
        found = [(p, doc) for p in closed if (doc := _phase_doc(run, p)).get("request_id") == request]
        if not found:
            return None  # a new request
        (number, boundary), doc = found[-1]
        if doc.get("policy_hash") != checked.policy.hash:
            raise ConfigError(
                f"{run.path(phase_folder(number, boundary))}/phase.json: request {request!r} was a pivot to "
                f"the policy of hash {doc.get('policy_hash')}, not to {name!r} ({checked.policy.hash}): "
                "not pivoting; give this pivot a request id of its own"
            )
        what = f"request {request!r} is done: the pivot to policy {name!r} at step {boundary}"
    else:
        try:
            if read_policy(run).hash != checked.policy.hash:
                return None
        except (ConfigError, FileNotFoundError, ValueError):
            return None  # no policy in force, or not a policy: not this one (a disk error is raised)
        number, boundary = closed[-1]
        what = f"policy {name!r} is already in force: the pivot to it at step {boundary}"
    folder = run.path(phase_folder(number, boundary))
    newest = (run.checkpoint_steps() or [boundary])[-1]
    return {
        "boundary": boundary,
        "policy": name,
        "archive": {"folder": folder},
        "already": True,
        "trained_since": max(0, newest - boundary),
        "what": f"{what} closed {folder}",
    }


def _phase_doc(run: RunDir, phase: tuple[int, int]) -> dict:
    """A closed phase's phase.json ({} where it is missing or not JSON: it names no request). A disk
    error reading it is raised, never taken for "no request" (which would pivot a rerun again)."""
    try:
        doc = run.read_json(f"{phase_folder(*phase)}/phase.json")
    except (FileNotFoundError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


# --- step 1 ------------------------------------------------------------------------------------


def choose_boundary(run: RunDir) -> tuple[int, int]:
    """(decided at, pivot point): the next checkpoint on the grid after the step the live trainer is at
    (a pivot decided at step 112,619 pivots at step_112700.bin), and after every checkpoint already
    written (the loss log read can be older than the checkpoints: those are never the pivot point,
    see wait_for_boundary)."""
    every = read_run(run).config.train.checkpoint_every
    decided_at = supervise.logged_step(run) or 0
    newest = max(run.checkpoint_steps(), default=-1)
    return decided_at, boundary_after(max(decided_at, newest + 1), every)


def newest_checkpoint(run: RunDir, log: Log = print) -> int:
    """With no trainer running, the pivot point is the newest valid checkpoint. A trainer that took the
    run since the pivot looked (alive here or elsewhere) raises TrainerChanged: the pivot decides again,
    against it (take_pivot_checkpoint)."""
    verdict = trainer_liveness(run)
    if verdict.state in (ALIVE, UNKNOWN):
        held = verdict.holder
        raise supervise.TrainerChanged(
            f"{run.url}: trainer pid {held.pid} on {held.host} took the run (lease generation "
            f"{held.generation}) as the pivot looked for a checkpoint to pivot at"
        )
    ckpt = run.newest_valid_checkpoint(run_n_params(read_run(run)), warn=log)
    if ckpt is None:
        raise CheckpointError(run.url, "no valid checkpoint to pivot from")
    return ckpt.step


def signal_live_trainer(run: RunDir, signal_name: str) -> dict:
    """Signal the trainer that holds the run's lock (identity-checked: a recycled pid is never
    signalled); one that cannot be checked from here (another machine, another pid namespace) is asked
    through the run directory instead (lock.send_request: SIGUSR1 a checkpoint, SIGTERM a stop), which
    it reads at its next lease renewal. Returns what the run looked like just before, for waiting on
    the signal's effect. One verdict (trainer_liveness) decides how: a trainer gone meanwhile, or
    released, raises TrainerChanged (the caller looks again), never a refusal read from a second look."""
    verdict = trainer_liveness(run)
    trainer = verdict.holder
    if verdict.state == UNKNOWN:
        if signal_name not in ("SIGUSR1", "SIGTERM"):
            raise elsewhere_error(run, verdict, "signalling its trainer")
        request = "checkpoint" if signal_name == "SIGUSR1" else "stop"
        receipt = {"pid": trainer.pid, "signal": signal_name, "request": request}
        receipt |= {"logged_step": supervise.logged_step(run), "checkpoints": run.checkpoint_steps()}
        receipt["request_id"] = send_request(run, trainer, request)
        return receipt
    if verdict.state != ALIVE:
        raise supervise.TrainerChanged(f"{run.url}: no live trainer ({verdict.why})")
    receipt = {
        "pid": trainer.pid,
        "signal": signal_name,
        "logged_step": supervise.logged_step(run),
        "checkpoints": run.checkpoint_steps(),
    }
    try:
        trainer.signal(signal.Signals[signal_name])
    except ProcessLookupError as e:  # it exited between the verdict and the signal
        raise supervise.TrainerChanged(f"{run.url}: {e}") from None
    return receipt


def _holder(run: RunDir) -> TrainerIdentity | None:
    """The trainer holding the run: alive here, or one that cannot be checked from here (then reached
    through the run directory: signal_live_trainer); None when none holds it."""
    verdict = trainer_liveness(run)
    return verdict.holder if verdict.state in (ALIVE, UNKNOWN) else None


def take_pivot_checkpoint(run: RunDir, journal: PivotJournal, timeout_s: float, log: Log = print) -> int:
    """Step 1: the pivot checkpoint, protected by the journal (retention keeps it) before the trainer is
    stopped: the next one on the grid (at="boundary"), one written now (at="now", SIGUSR1), or with
    no trainer running the newest valid one. A trainer that stops holding the run before it wrote the
    pivot checkpoint (killed before the stop request, or taken over by one restarted in its place), or
    one that takes a run the pivot found free, does not fail the pivot: it decides again from whoever
    holds the run then, within the same timeout (TrainerChanged). A failure here leaves the run as it
    was (no journal)."""
    if journal.reached("checkpointed"):
        return journal.boundary
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                boundary = _pivot_point(run, journal, deadline, log)
                break
            except supervise.TrainerChanged as e:
                if time.monotonic() >= deadline:
                    raise
                log(f"{e}: deciding again")
        if journal.restart != "none":
            require_steps_after(journal.max_steps, boundary)
        journal.record(run, "checkpointed", boundary=boundary, not_before=None)
    except BaseException:
        clear_pivot(run)  # nothing was changed: the run trains on as before
        raise
    log(f"pivot checkpoint {checkpoint_name(boundary)} is valid")
    _kill_point("checkpointed")
    return boundary


def _pivot_point(run: RunDir, journal: PivotJournal, deadline: float, log: Log) -> int:
    """One decision of step 1 against whoever holds the run now (take_pivot_checkpoint)."""
    trainer = _holder(run)
    left = max(0.0, deadline - time.monotonic())
    if trainer is None:
        boundary = newest_checkpoint(run, log)
        log(f"no trainer running: pivoting at the newest valid checkpoint, step {boundary}")
        return boundary
    if journal.at == "now":
        # Which checkpoint the SIGUSR1 writes is not known yet: protect all from here on.
        journal.record(run, "intent", boundary=None, not_before=supervise.logged_step(run) or 0)
        receipt = signal_live_trainer(run, "SIGUSR1")
        how = f"asked ({REQUEST})" if receipt.get("request") else "sent SIGUSR1 to"
        log(f"{how} trainer pid {receipt['pid']} on {trainer.host}: a checkpoint of the step in flight")
        return supervise.wait_for_new_checkpoint(
            run, receipt["logged_step"] or 0, set(receipt["checkpoints"]), left, trainer=trainer
        ).step
    return wait_for_boundary(run, journal, left, trainer, log)


def wait_for_boundary(
    run: RunDir, journal: PivotJournal, timeout_s: float, trainer: TrainerIdentity, log: Log = print
) -> int:
    """The next checkpoint on the grid after where the trainer is, protected by the journal's intent
    before it is written. A view of the trainer's step is old by the time the intent is on disk (the
    loss log read, a slow machine, a slow store): when the trainer has passed the boundary meanwhile,
    its checkpoint was never protected (retention may have removed it) or never written (its write
    failed), and the pivot decides again from where the trainer is now, within the same timeout.

    A boundary is protected only for the retention passes that read pivot.json after the intent: a
    pass lists the checkpoints, reads the protections, then deletes, so one that read them just before
    the intent can still delete a boundary checkpoint that was already written, after the pivot saw it
    valid (the soak's fault 396: "step_045605.bin: no such file" once the trainer had stopped, the run
    left with a half-done pivot no rerun could finish). So a boundary must be written after its intent:
    if any checkpoint at or past it is on disk once the intent is, the pivot decides again."""
    deadline = time.monotonic() + timeout_s
    while True:
        decided_at, boundary = choose_boundary(run)
        if journal.restart != "none":
            require_steps_after(journal.max_steps, boundary)
        journal.record(run, "intent", boundary=boundary, not_before=None)
        log(f"pivot decided at step {decided_at}: pivoting at step {boundary}")
        written = [s for s in run.checkpoint_steps() if s >= boundary]
        if written:
            log(
                f"{run.url}: the trainer wrote {checkpoint_name(written[0])} before the intent protected "
                f"{checkpoint_name(boundary)} (a retention pass may still remove it): deciding again"
            )
            if time.monotonic() > deadline:
                raise SupervisionError(
                    f"{run.url}: no checkpoint boundary ahead of the trainer within {timeout_s:.0f}s "
                    f"(trainer at step {supervise.logged_step(run)})"
                )
            continue
        try:
            left = max(0.0, deadline - time.monotonic())
            return supervise.wait_for_checkpoint(run, boundary, left, trainer=trainer).step
        except supervise.CheckpointPassed as e:
            log(f"{e}: deciding again")


# --- step 2 ------------------------------------------------------------------------------------


def stop_trainer(run: RunDir, journal: PivotJournal, timeout_s: float = 300.0, log: Log = print) -> dict:
    """Step 2: SIGTERM the trainer (identity-checked) and wait for its exit: by then it has checkpointed
    the step in flight. Records .loss.json as it is now: every later step checks it byte for byte.
    "stopped" is recorded only once no trainer holds the run after it is on disk: a trainer that took
    the lock just before read the journal before it (a trainer checks it under its lock) and trains,
    so it is stopped as well and .loss.json recorded again; a rerun at "stopped" does the same."""
    if journal.reached("stopped") and (journal.step != "stopped" or _holder(run) is None):
        pid = journal.stopped_pid
        return {
            "stopped": pid is not None,
            "pid": pid,
            "step": journal.stopped_step,
            # Never a run file's number (a journal can be forged): a rerun restarts one process,
            # which resumes the checkpoint as well (any world size); pass --nproc-per-node for more.
            "world_size": 1,
            "seconds": 0.0,
        }
    deadline = time.monotonic() + timeout_s
    while True:
        stopped = stop_live_trainer(run, max(0.0, deadline - time.monotonic()), log)
        if journal.loss_before is not None:
            journal.loss_before.check_prefix_of(run, "the stopped trainer's .loss.json")
        journal.record(
            run,
            "stopped",
            loss_at_stop=LossLogSnapshot.take(run),
            stopped_pid=stopped["pid"] if stopped["pid"] is not None else journal.stopped_pid,
            stopped_step=stopped["step"],
        )
        late = _holder(run)
        if late is None:
            break
        log(
            f"trainer pid {late.pid} on {late.host} took the run (lease generation {late.generation}) "
            "before the pivot recorded the stop: stopping it too"
        )
    _kill_point("stopped")
    return stopped


def job_world_size(pid: int) -> int:
    """The world size of the torchrun job whose rank 0 is `pid`, from the WORLD_SIZE torchrun gave that
    process (the operator's choice, never a run file's), bounded by the devices here; 1 if none."""
    from andrea_core.signals import environ_of
    from andrea_core.train.launch import check_world_size

    try:
        raw = environ_of(pid).get("WORLD_SIZE", "1")
    except OSError:
        return 1
    return check_world_size(int(raw) if raw.isdigit() else raw, f"trainer pid {pid}'s WORLD_SIZE")


def stop_live_trainer(run: RunDir, timeout_s: float = 300.0, log: Log = print) -> dict:
    """SIGTERM the trainer of `run` (identity-checked) and wait until it has exited: by then it has
    checkpointed the step in flight. One that cannot be checked from here is asked to stop through the
    run directory (signal_live_trainer) and waited for until it releases the lock. A trainer that takes
    the run over meanwhile (one restarted, as systemd would, after the one asked died) is stopped in
    turn, within the same timeout: the run is stopped once no trainer holds it. A run with no live
    trainer is left alone."""
    deadline = time.monotonic() + timeout_s
    trainer = _holder(run)
    last: TrainerIdentity | None = None
    waited = 0.0
    world_size = 1
    while trainer is not None:
        if last is not None:
            log(
                f"trainer pid {trainer.pid} on {trainer.host} took the run over (lease generation "
                f"{trainer.generation}) while the pivot waited for pid {last.pid} to stop: stopping it too"
            )
        local_world_size = job_world_size(trainer.pid)  # read while it runs; trusted only if signalled
        try:
            receipt = signal_live_trainer(run, "SIGTERM")
        except supervise.TrainerChanged:  # gone (or released) between the look and the signal: look again
            last, trainer = trainer, _holder(run)
            continue
        if receipt.get("request"):
            log(f"asked trainer pid {trainer.pid} on {trainer.host} to stop ({run.path(REQUEST)})")
            world_size = 1
        else:  # signalled: the pid was checked to be this run's trainer, so its WORLD_SIZE is its job's
            world_size = local_world_size
        left = max(0.0, deadline - time.monotonic())
        waited += supervise.wait_for_exit(trainer, left, run=run)
        last, trainer = trainer, _holder(run)
    newest = (run.checkpoint_steps() or [None])[-1]  # the stop's own checkpoint, past a pivot point
    if last is None:
        log(f"{run.url}: no live trainer to stop")
    else:
        log(
            f"trainer pid {last.pid} on {last.host} exited {waited:.1f}s after being asked to stop; "
            f"newest checkpoint {newest}"
        )
    return {
        "stopped": last is not None,
        "pid": last.pid if last is not None else None,
        "step": newest,
        "world_size": world_size,
        "seconds": waited,
    }


def loss_at_stop(journal: PivotJournal) -> LossLogSnapshot:
    if journal.loss_at_stop is None:
        raise ConfigError(f"the pivot journal at step {journal.step!r} records no .loss.json at the stop")
    return journal.loss_at_stop


# --- steps 3 to 5 ------------------------------------------------------------------------------


def archive(run: RunDir, journal: PivotJournal, log: Log = print, timeout_s: float = 300.0) -> dict:
    """Step 3: move .samples.json, .state.json, (a copy of) policy.yaml and the checkpoints past the
    boundary into archive/phase_NNN_step_SSSSSS/, a folder named in the journal before the first move
    (a rerun finishes the moves into the same folder). Afterwards the run holds no bandit state or
    sample log, so the next trainer starts a fresh bandit, and its newest checkpoint is the boundary.
    Only once no trainer holds the run (_archive_when_free), waiting at most `timeout_s`."""
    boundary = journal.boundary
    if not journal.reached("archived"):
        if not journal.archive:
            journal.record(run, "archiving", archive=next_phase_folder(run, boundary))
        moves = iter(range(1, 1_000_000))
        archived = _archive_when_free(
            run, journal, timeout_s, log, lambda _: _kill_point(f"archive-move-{next(moves)}")
        )
        journal.record(run, "archived")
        log(f"archived {', '.join(archived.moved) or 'nothing left to move'} into {archived.folder}")
        _kill_point("archived")
    if journal.reached("installed"):
        return {"folder": run.path(journal.archive)}  # the new phase may be training already
    left = [name for name in (SAMPLES, STATE) if run.exists(name)]
    if left:
        raise SupervisionError(f"{run.url}: {', '.join(left)} still present after archiving")
    newest = run.checkpoint_steps()[-1]
    if newest != boundary:
        raise SupervisionError(
            f"{run.url}: newest checkpoint is step {newest}, not the pivot point {boundary}"
        )
    return {"folder": run.path(journal.archive)}


def _archive_when_free(
    run: RunDir, journal: PivotJournal, timeout_s: float, log: Log, after_move: Callable[[str], None]
) -> ArchivedPhase:
    """archive_phase once no trainer holds the run. The stop is on disk with no holder after it (step
    2), so a trainer holding the run now took it since: it read the journal under its lock, found the
    pivot half done and refuses to train (exit 2), releasing the run. It is asked to stop as well and
    waited for, within `timeout_s`, as step 2 waits; never taken for a trainer that forbids archiving
    (the soak's pivot-remote: a rerun saw no holder, met that one and exited 2, "cannot be checked from
    here", a half-done pivot left for a third run)."""
    deadline = time.monotonic() + timeout_s
    while True:
        late = _holder(run)
        if late is not None:
            log(
                f"trainer pid {late.pid} on {late.host} took the run (lease generation {late.generation}) "
                "after the stop was recorded: it refuses to train a half-done pivot; waiting for it to "
                "release the run"
            )
            stop_live_trainer(run, max(0.0, deadline - time.monotonic()), log)
        try:
            by = {"policy_hash": journal.policy_hash, "request_id": journal.request_id}
            return archive_phase(run, journal.boundary, journal.archive, after_move=after_move, closed_by=by)
        except LockError:  # taken again between the look and the archive's own check (before any move)
            if time.monotonic() >= deadline:
                raise


def keep_loss_log(run: RunDir, journal: PivotJournal) -> dict:
    """Step 4: .loss.json stays exactly where and as it is: checked byte for byte against its state
    when the trainer stopped."""
    snapshot = loss_at_stop(journal)
    if journal.reached("installed"):
        snapshot.check_prefix_of(run)  # a rerun: the resumed trainer may have appended already
    else:
        snapshot.check_unchanged(run)
    if not journal.reached("loss-kept"):
        journal.record(run, "loss-kept")
        _kill_point("loss-kept")
    return {"bytes": snapshot.size, "sha256": snapshot.sha256}


def install(run: RunDir, journal: PivotJournal) -> str:
    """Step 5: the new policy.yaml (validated again: what is installed is what was checked)."""
    if not journal.reached("installed"):
        installed = install_policy(run, journal.policy_text, journal.source or "new policy")
        if journal.max_steps is not None:  # the target the new phase trains to (a no-op if kept)
            cfg = read_run(run).config
            set_target(run, journal.max_steps, cfg.train.max_steps, journal.boundary or 0, "andrea pivot")
        journal.record(run, "installed")
        _kill_point("installed")
        return installed.hash
    return journal.policy_hash


# --- step 6 ------------------------------------------------------------------------------------


def trainer_log_path(run: RunDir) -> str:
    """Where a detached trainer writes its output: RUN/trainer.log; for a run on an object store (which
    has no appends) trainer.log in this machine's cache of the run (RunDir.log_path), printed."""
    return run.log_path("trainer.log")


def start_detached_trainer(run: RunDir, options: dict | None = None) -> tuple[subprocess.Popen, str]:
    """The resumed trainer as a process of its own session, outliving the shell that started it, with
    `options` (recorded_train_options: the stopped trainer's command line), its output appended to
    trainer_log_path(run). Returns the process and the log's path."""
    from andrea_core.command import train_argv

    o = {"device": "auto", "max_steps": None, "pace": 0.0, "nproc_per_node": 1, **(options or {})}
    argv = train_argv(
        run.url,
        device=o["device"],
        max_steps=o["max_steps"],
        pace=o["pace"],
        nproc_per_node=o["nproc_per_node"],
    )
    path = trainer_log_path(run)
    with run.open_log("trainer.log") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=supervise.trainer_env(),
            start_new_session=True,
            cwd=REPO_ROOT,
        )
    return proc, path


def confirm_resumed(
    run: RunDir, journal: PivotJournal, timeout_s: float, ended: Callable[[], str | None] | None = None
) -> dict:
    """Step 6's proof: the new trainer's first loss is for step boundary+1 (it resumed from the pivot
    checkpoint), the old history is a byte-for-byte prefix of .loss.json, and it is not the trainer
    that was stopped. `ended` reports the resumed trainer's end: one that died is reported at once."""
    boundary, snapshot = journal.boundary, loss_at_stop(journal)
    entry = supervise.wait_for_first_entry_after(run, snapshot, timeout_s, ended=ended)
    if entry["step"] != boundary + 1:
        raise SupervisionError(
            f"{run.url}: the resumed trainer logged step {entry['step']} first; expected {boundary + 1} "
            f"(a resume from {checkpoint_name(boundary)})"
        )
    snapshot.check_prefix_of(run)
    verdict = trainer_liveness(run)  # one look: a holder alive here is judged, one elsewhere reported
    holder = verdict.holder if verdict.state in (ALIVE, UNKNOWN) else None
    elsewhere = holder if verdict.state == UNKNOWN else None
    if holder is not None and elsewhere is None and holder.pid == journal.stopped_pid:
        raise SupervisionError(f"{run.url}: trainer pid {holder.pid} is still the one running")
    if not journal.reached("restarted"):
        journal.record(run, "restarted")
        _kill_point("restarted")
    return {
        "first_step": entry["step"],
        "first_loss": entry["loss"],
        "segment": entry["segment"],
        "arm": entry.get("arm"),
        "pid": holder.pid if holder else None,
        **({"host": elsewhere.host} if elsewhere is not None else {}),
    }


def _ended_unheld(run: RunDir, resumed: Resumed | None) -> Callable[[], str | None] | None:
    """How the started trainer ended, once it has and no other trainer holds the run: one restarted
    elsewhere (systemd there) may take the lock between the install and this one's start, and it trains
    the new phase (this one is refused, or waits on its lease); its first step is then waited for."""
    if resumed is None or resumed.ended is None:
        return None

    def ended() -> str | None:
        why = resumed.ended()
        return why if why is not None and _holder(run) is None else None

    return ended


def _name_started(confirmed: dict, resumed: Resumed) -> None:
    """The trainer this pivot started in confirm_resumed's answer: the run's trainer when none held the
    run at the look (it may have trained and exited already); named apart, as "started" (its pid, and
    how it ended if it has), when another did. Never one trainer's pid beside the other's host."""
    started = resumed.info["pid"]
    if confirmed["pid"] is None:
        confirmed["pid"] = started
    elif "host" in confirmed or confirmed["pid"] != started:
        confirmed["started"] = {"pid": started, "ended": resumed.ended() if resumed.ended else None}


def finish_pivot(run: RunDir) -> None:
    """The pivot is complete: the journal goes (the archived phase's folder protects the boundary)."""
    clear_pivot(run)


# --- the whole pivot: the one driver -----------------------------------------------------------


@dataclass
class Resumed:
    """A resumed trainer, as the front end that started it reports it."""

    info: dict  # what the result shows of it: a pid and its log, or a flow run's id and name
    ended: Callable[[], str | None] | None = None  # how it ended, once it has (None while it runs)
    outcome: Callable[[], dict] | None = None  # its end, waited for once the pivot is complete


@dataclass(frozen=True)
class Restart:
    """How a front end starts the resumed trainer with the options the pivot gives it (device,
    max_steps, pace, nproc_per_node): `andrea pivot` a detached process (detached_restart), the flow a
    `train` deployment run or subflow (flows/pivot.py). `name` is recorded in the journal."""

    name: str
    start: Callable[[RunDir, dict], Resumed]


# step(name, fn): how a front end runs each named step (the flow: as a Prefect task of that name).
StepRunner = Callable[[str, Callable[[], Any]], Any]
PIVOT_STEP_NAMES = (
    "check-not-already-pivoted",
    "begin-pivot",
    "take-pivot-checkpoint",
    "stop-trainer",
    "archive-phase",
    "keep-loss-log",
    "install-policy",
    "confirm-resumed-trainer",
    "finish-pivot",
)


def _plain(name: str, fn: Callable[[], Any]) -> Any:
    return fn()


def run_pivot(
    run: RunDir,
    checked: PivotCheck,
    *,
    at: str = "boundary",
    restart: Restart | None = None,
    timeout_s: float = 1800.0,
    log: Log = print,
    step: StepRunner = _plain,
) -> dict:
    """The pivot, once for every front end (checked: check_pivot's verdict, made before this): the
    six steps against the live trainer (or the newest valid checkpoint when none runs), each journaled,
    each waiting at most `timeout_s`; then, with `restart`, the resumed trainer started the front end's
    way with the stopped trainer's options (checked.train; max_steps the journal's target) and
    confirmed by its first step. A rerun after a crash resumes from the journal's last step."""
    done = step("check-not-already-pivoted", lambda: already_pivoted(run, checked, restart is not None, log))
    if done is not None:
        return done
    how = restart.name if restart is not None else "none"
    journal: PivotJournal = step("begin-pivot", lambda: begin_pivot(run, checked, at, how, log))
    boundary = step("take-pivot-checkpoint", lambda: take_pivot_checkpoint(run, journal, timeout_s, log))
    stopped = step("stop-trainer", lambda: stop_trainer(run, journal, timeout_s, log))
    archived = step("archive-phase", lambda: archive(run, journal, log, timeout_s))
    kept = step("keep-loss-log", lambda: keep_loss_log(run, journal))
    log(f".loss.json untouched: {kept['bytes']} bytes, sha256 {kept['sha256'][:16]}")
    step("install-policy", lambda: install(run, journal))
    log(f"installed policy {journal.policy!r} (hash {journal.policy_hash}); .loss.json untouched")
    result = {"boundary": boundary, "policy": journal.policy, "archive": archived, "stopped": stopped}
    if restart is None:
        step("finish-pivot", lambda: finish_pivot(run))
        _kill_point("finished")  # complete, not yet exited: a rerun finds it done (already_pivoted)
        return result
    resumed = None
    if not journal.reached("restarted"):
        # A rerun may find the trainer it started before a crash, or one started on another host
        # (systemd there): whoever holds the run trains the new phase; a second would wait on its lease.
        if _holder(run) is None:
            options = dict(journal.train_options or checked.train or {})
            options["max_steps"] = journal.max_steps
            # The stopped job's verified WORLD_SIZE (stop_live_trainer), never the journal's number; the
            # recorded options' own is bounded by the devices here when the trainer starts (cmd_train).
            options["nproc_per_node"] = stopped.get("world_size") or 1
            resumed = restart.start(run, options)
            result["resumed_by"] = resumed.info
        ended = _ended_unheld(run, resumed)
        result["resumed"] = step(
            "confirm-resumed-trainer", lambda: confirm_resumed(run, journal, timeout_s, ended)
        )
        if resumed is not None and resumed.info.get("pid") is not None:
            _name_started(result["resumed"], resumed)
    else:
        result["resumed"] = {"first_step": boundary + 1, "pid": getattr(live_trainer(run), "pid", None)}
    step("finish-pivot", lambda: finish_pivot(run))
    _kill_point("finished")  # the resumed trainer trains on: a rerun finds the pivot done all the same
    if resumed is not None and resumed.outcome is not None:
        result["resumed_outcome"] = resumed.outcome()
    return result


def detached_restart(log: Log = print) -> Restart:
    """`andrea pivot`'s restart: a detached trainer (start_detached_trainer), its output in its log."""

    def start(run: RunDir, options: dict) -> Resumed:
        proc, path = start_detached_trainer(run, options)
        log(f"resumed trainer pid {proc.pid} ({' '.join(proc.args[3:])}), output in {path}")

        def ended() -> str | None:
            if proc.poll() is None:
                return None
            return f"trainer pid {proc.pid} exited with status {proc.returncode} (see {path})"

        return Resumed({"pid": proc.pid, "log": path}, ended)

    return Restart("detached", start)


# --- abandoning a pivot ------------------------------------------------------------------------


def abandon(run: RunDir, log: Log = print) -> dict:
    """Undo a pivot that stopped part-way: move the archived sidecars and tail checkpoints back, put the
    old policy back, remove the phase folder and the journal. The run is then the old phase again.

    Nothing is deleted unless a byte-identical copy stays: an archived file is removed only where the
    run holds the same bytes under its name. Once the new phase has trained (its .state.json,
    .samples.json or a checkpoint past the boundary are not the archived old phase's), abandoning would
    discard that training or resume the old policy from the new phase's files: it is refused before
    anything is touched (the pivot is complete in all but its journal: rerun it to finish it). A dead
    writer's temporary file in the phase folder (a SIGKILL during a write there) is cleared."""
    journal = read_pivot(run)
    if journal is None:
        raise ConfigError(f"{run.url}: no pivot under way (no {PIVOT_JSON}): nothing to abandon")
    if "unreadable" in journal:  # forged or damaged: nothing it names is moved or deleted
        raise ConfigError(
            f"{journal['unreadable']}: not abandoning by it (nothing moved); inspect it, then remove it"
        )
    if (pid := owner_alive(journal)) is not None:
        raise LockError(
            f"{run.path(PIVOT_JSON)}: the pivot to {journal.get('policy')!r} is still being run by process "
            f"{pid} (step {journal.get('step')!r}): not abandoning (nothing was changed); let it finish, "
            "or stop it and then abandon"
        )
    verdict = require_not_elsewhere(run, "abandoning the pivot")
    trainer = verdict.holder if verdict.state == ALIVE else None
    step = journal.get("step")
    if trainer is not None and step not in (None, "intent", "checkpointed"):
        raise LockError(
            f"{run.url}: trainer pid {trainer.pid} is running (pivot step {step!r}); "
            "stop it before abandoning"
        )
    restored = []
    folder = journal.get("archive")
    if trainer is None and isinstance(folder, str) and PHASE_FOLDER_RE.fullmatch(folder):
        plan = _abandon_plan(run, journal, folder)
        for name in plan["temporary"]:
            run.remove(f"{folder}/{name}")
            log(f"removed {run.path(f'{folder}/{name}')}, left by a writer that did not finish")
        for name in plan["back"]:
            if name in plan["same"]:
                run.remove(f"{folder}/{name}")  # the run holds these very bytes
            else:
                run.move(f"{folder}/{name}", name)
            restored.append(name)
        if POLICY_YAML in plan["names"]:
            run.write_atomic(POLICY_YAML, run.read_bytes(f"{folder}/{POLICY_YAML}"))
            run.remove(f"{folder}/{POLICY_YAML}")
            restored.append(POLICY_YAML)
        if "phase.json" in plan["names"]:
            run.remove(f"{folder}/phase.json")
        run.remove_folder(folder)
    target = _restore_target(run, journal) if trainer is None else None
    clear_pivot(run)
    if target is not None:
        log(f"the run's target is {target} again, as before the pivot")
    log(
        f"abandoned the pivot to {journal.get('policy')!r} (last step {step!r}); "
        f"restored {restored or 'nothing'}"
    )
    return {"policy": journal.get("policy"), "step": step, "restored": restored}


def _restore_target(run: RunDir, journal: dict) -> int | None:
    """The target in force before the pivot (the journal's target_before), in force again."""
    before = journal.get("target_before")
    if not isinstance(before, int) or isinstance(before, bool):
        return None  # a journal written before targets were recorded in it
    cfg = read_run(run).config
    if read_target(run, cfg.train.max_steps).max_steps == before:
        return None
    steps = run.checkpoint_steps()
    set_target(run, before, cfg.train.max_steps, steps[-1] if steps else 0, "andrea pivot --abandon")
    return before


def _doc_reached(journal: dict, step: str) -> bool:
    done = journal.get("step")
    return done in PIVOT_STEPS and PIVOT_STEPS.index(done) >= PIVOT_STEPS.index(step)


def _abandon_plan(run: RunDir, journal: PivotJournal, folder: str) -> dict:
    """What abandoning moves back, checked whole before anything is touched: raises ConfigError for a
    phase folder holding a file abandon does not know, and for a new phase that has trained."""
    from andrea_core.checkpoint import step_from_name
    from andrea_core.run.loss_log import read_history
    from andrea_core.run.rundir import TEMP_RE

    names = run.listdir(folder)
    temporary = [n for n in names if TEMP_RE.fullmatch(n)]
    writing = [n for n in temporary if not run.is_dead_temporary(f"{folder}/{n}")]
    if writing:
        raise ConfigError(
            f"{run.path(folder)}: {', '.join(writing)} is being written by a live process (another pivot "
            "of this run?): not abandoning (nothing was changed); let it finish, then run this again"
        )
    back = [n for n in names if n in (SAMPLES, STATE) or step_from_name(n) is not None]
    unknown = sorted(set(names) - set(temporary) - set(back) - {POLICY_YAML, "phase.json"})
    if unknown:
        raise ConfigError(
            f"{run.path(folder)}: holds {', '.join(unknown)}, which no pivot writes there: not abandoning "
            "(nothing was changed); move them out of the phase folder first"
        )
    same = {n for n in back if run.exists(n) and run.read_bytes(n) == run.read_bytes(f"{folder}/{n}")}
    boundary = journal.get("boundary")
    # Files of the run that abandoning would overwrite with other bytes; and once the new policy is
    # installed (a trainer may start from then on, never before), the new phase's own files that would
    # be left beside the restored old phase.
    ours = [n for n in back if run.exists(n) and n not in same]
    if _doc_reached(journal, "installed"):
        ours += [n for n in (SAMPLES, STATE) if run.exists(n) and n not in back]
        ours += [
            checkpoint_name(s)
            for s in run.checkpoint_steps()
            if boundary is not None and s > boundary and checkpoint_name(s) not in back
        ]
    if ours:
        history = read_history(run)
        newest = max([e.step for e in history] + [step_from_name(n) or 0 for n in ours])
        trained = f"steps {boundary + 1}..{newest}" if boundary is not None and newest > boundary else "steps"
        raise ConfigError(
            f"{run.url}: the new phase trained {trained} (policy {journal.get('policy')!r}, pivot step "
            f"{journal.get('step')!r}; {', '.join(sorted(ours))}: its own, not the archived old phase's); "
            "abandoning would discard them: nothing was changed. The pivot is complete but for its journal: "
            f"finish it (andrea pivot {run.url} --policy {journal.get('source') or journal.get('policy')})"
        )
    return {"names": names, "temporary": temporary, "back": back, "same": same}
